"""In-place recovery (FailureConfig(recover_in_place=True)): when a rank fails, the others keep
their processes, the failed rank starts again, the state of the last complete report goes from a
survivor to every rank over the new process group, and the run still ends bit for bit like the
uninterrupted one, each iteration once.

Real worker processes: 2 ranks on gloo (DDP), the local engine, `exact_loop` with
TrainState(jit_checkpoint=True, step_seed=...), a periodic checkpoint every 4 steps; the
failures strike right after the report of step 6.
"""

import json
import os

import pytest

from loops import exact_loop
from test_exact_resume import BASE, assert_same_run
from test_jit_checkpoint import PERIODIC, STEP
from unbroken.train import FailureConfig, RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer


def fit(storage, name, max_failures=1, in_place=True, **config):
    return TorchTrainer(exact_loop, train_loop_config={**BASE, "jit": True, **config},
                        scaling_config=ScalingConfig(num_workers=2),
                        run_config=RunConfig(name=name, storage_path=storage, failure_config=FailureConfig(
                            max_failures=max_failures, recover_in_place=in_place))).fit()


def attempts(result) -> list[dict]:
    return json.load(open(os.path.join(result.path, ".unbroken", "run.json")))["attempts"]


def pids(directory, attempt) -> list[int]:
    return [int(open(os.path.join(directory, f"rank{r}-a{attempt}")).read()) for r in range(2)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run with per-step random streams."""
    return fit(str(tmp_path_factory.mktemp("in-place")), "reference", max_failures=0, in_place=False)


def test_a_killed_rank_is_replaced_while_the_survivor_keeps_its_process_and_state(storage, reference, tmp_path):
    result = fit(storage, "killed", die_after_report=[[STEP, 1, 1, "sigkill"]], pid_dir=str(tmp_path))
    first, second = attempts(result)
    assert (first["status"], second["status"]) == ("ERRORED", "FINISHED")
    assert second["in_place"] == {"iteration": STEP, "source": 0, "kept": [0], "replaced": [1]}, second
    assert second["resumed_from"] is None and second["resumed_iteration"] == STEP
    assert first.get("jit_checkpoint") is None, "nothing was saved to storage for the recovery"
    before, after = pids(tmp_path, 1), pids(tmp_path, 2)
    assert after[0] == before[0], "rank 0 kept its process"
    assert after[1] != before[1], "rank 1 runs in a new process"
    names = sorted(n for n in os.listdir(result.path) if n.startswith("checkpoint_"))
    assert f"checkpoint_{STEP:06d}" not in names, "no checkpoint of step 6 was written for the recovery"
    assert_same_run(result, reference, "rank 1 killed after report 6, recovered in place")


def test_a_rank_that_raised_stays_too_and_nobody_is_replaced(storage, reference, tmp_path):
    result = fit(storage, "raised", die_after_report=[[STEP, 1, 1, "raise"]], pid_dir=str(tmp_path))
    first, second = attempts(result)
    assert second["in_place"] == {"iteration": STEP, "source": 0, "kept": [0, 1], "replaced": []}, second
    assert pids(tmp_path, 2) == pids(tmp_path, 1), "both ranks kept their processes"
    assert_same_run(result, reference, "rank 1 raised after report 6, recovered in place")


def test_a_step_in_flight_falls_back_to_the_restart_from_the_periodic_checkpoint(storage, reference):
    # Rank 1 raises after step 6's optimizer step, before its report: no rank is clean since
    # report 5, so no rank can stay, and the run restarts from checkpoint 4 as before.
    result = fit(storage, "dirty", kill_at=[[STEP, 1, 1, "raise"]])
    first, second = attempts(result)
    assert second.get("in_place") is None and second["resumed_from"] == f"checkpoint_{PERIODIC:06d}"
    assert "an optimizer step began after report 5" in first["jit_checkpoint"]["why_not"], first
    assert_same_run(result, reference, "rank 1 raised after step 6's optimizer step")
