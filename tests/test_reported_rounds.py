"""A round every rank reported is kept, whatever a rank does right after reporting.

Once every rank has sent report N, round N is recorded and its checkpoint committed
before the failure that follows is handled. It is a race between the ranks' messages,
so each case runs many times.
"""

import json
import os

import pytest

from loops import report_then_die
from unbroken.train import DataParallelTrainer, FailureConfig, RunConfig, ScalingConfig

CASES = [(workers, how, dying) for workers in (2, 3) for how in ("raise", "exit", "sigkill")
         for dying in ("all", "first", "last")]
# The default run: every way to die with 2 ranks; with 3, the last rank dying each way (two
# survivors, which 2 ranks lack). The soak runs every case, 15 times as often.
SAMPLE = [(workers, how, dying) for workers, how, dying in CASES if workers == 2 or dying == "last"]


@pytest.mark.parametrize("workers,how,dying", SAMPLE)
def test_a_fully_reported_round_survives_the_failure_after_it(storage, workers, how, dying):
    check_round_kept(storage, workers, how, dying, repeats=4)


@pytest.mark.slow
@pytest.mark.parametrize("workers,how,dying", CASES)
def test_a_fully_reported_round_survives_the_failure_after_it_soak(storage, workers, how, dying):
    check_round_kept(storage, workers, how, dying, repeats=60)


@pytest.mark.parametrize("how", ["raise", "exit", "sigkill"])
def test_a_round_completes_when_a_slower_rank_reports_after_the_failure(storage, tmp_path, how):
    """Rank 0 reports and dies while rank 1 is still writing its files: rank 1's report,
    sent only once rank 0 is dead, still completes and commits the round."""
    fifo = str(tmp_path / "rank0-alive")
    os.mkfifo(fifo)
    check_round_kept(storage, 2, how, "first", repeats=2, death_fifo=fifo)


def check_round_kept(storage, workers, how, dying, repeats, death_fifo=None):
    ranks = {"all": list(range(workers)), "first": [0], "last": [workers - 1]}[dying]
    for i in range(repeats):
        result = DataParallelTrainer(
            report_then_die, train_loop_config={"dying": ranks, "how": how, "death_fifo": death_fifo},
            scaling_config=ScalingConfig(num_workers=workers),
            run_config=RunConfig(name=f"r{i}", storage_path=storage,
                                 failure_config=FailureConfig(max_failures=1))).fit()
        path = result.path
        attempts = json.load(open(os.path.join(path, ".unbroken", "run.json")))["attempts"]
        assert attempts[0]["status"] == "ERRORED", attempts
        assert attempts[1]["resumed_from"] == "checkpoint_000001", f"repetition {i}: {attempts}"
        df = result.metrics_dataframe
        assert list(df["training_iteration"]) == [1, 2]
        assert list(df["attempt"]) == [1, 2]
        # Every rank's file made it into the committed checkpoint.
        assert df["resumed_with"].iloc[-1] == [f"rank{r}.txt" for r in range(workers)]
        assert not [e for e in os.listdir(path) if ".tmp-" in e]
