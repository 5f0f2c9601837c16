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


@pytest.mark.parametrize("workers,how,dying", CASES)
def test_a_fully_reported_round_survives_the_failure_after_it(storage, workers, how, dying):
    check_round_kept(storage, workers, how, dying, repeats=6)


@pytest.mark.slow
@pytest.mark.parametrize("workers,how,dying", CASES)
def test_a_fully_reported_round_survives_the_failure_after_it_soak(storage, workers, how, dying):
    check_round_kept(storage, workers, how, dying, repeats=60)


@pytest.mark.parametrize("how", ["raise", "sigkill"])
def test_a_round_completes_when_a_slower_rank_reports_after_the_failure(storage, how):
    """Rank 0 reports and dies while rank 1 is still writing its files: rank 1's report,
    sent after the failure was seen, still completes and commits the round."""
    check_round_kept(storage, 2, how, "first", repeats=2, lag_s=0.5)


def check_round_kept(storage, workers, how, dying, repeats, lag_s=0.0):
    ranks = {"all": list(range(workers)), "first": [0], "last": [workers - 1]}[dying]
    for i in range(repeats):
        result = DataParallelTrainer(
            report_then_die, train_loop_config={"dying": ranks, "how": how, "lag_s": lag_s},
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
