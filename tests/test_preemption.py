"""Preemption (SIGTERM / SIGINT to the driver) and hung workers."""

import json
import os
import signal

import pytest
import torch

from conftest import read_until, run_script, start_script
from loops import final_weights, linear_loop
from unbroken.store import commit
from unbroken.store.storage import Storage
from unbroken.train import FailureConfig, Result, RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer

DRIVER = """
import json, sys
from loops import linear_loop
from unbroken.train import RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer
storage, name, config = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
result = TorchTrainer(linear_loop, train_loop_config=config, scaling_config=ScalingConfig(num_workers=2),
                      run_config=RunConfig(name=name, storage_path=storage)).fit()
print("DONE", result.metrics["training_iteration"])
"""

RESTORE = """
import sys
from unbroken.train.torch import TorchTrainer
result = TorchTrainer.restore(sys.argv[1]).fit()
print("DONE", result.metrics["training_iteration"])
"""

ITERATIONS = 30
# Checkpoints only when asked (ckpt_every is beyond the run's end).
CONFIG = {"iterations": ITERATIONS, "ckpt_every": 1000, "on_request": True, "echo": True}


def manifest(path: str) -> dict:
    return json.load(open(os.path.join(path, ".unbroken", "run.json")))


@pytest.mark.parametrize("how", ["sigterm-driver", "sigterm-process-group-forkserver",
                                 pytest.param("sigint-process-group", marks=pytest.mark.slow)])
def test_signal_checkpoints_stops_and_restores_without_losing_iterations(storage, how):
    name = f"preempted-{how}"
    path = os.path.join(storage, name)
    method = {"UNBROKEN_START_METHOD": "forkserver"} if how.endswith("forkserver") else {}
    driver = start_script(DRIVER, storage, name, json.dumps(CONFIG), start_new_session=True, **method)
    read_until(driver, "REPORTED 4")
    if how == "sigterm-driver":
        driver.send_signal(signal.SIGTERM)
    else:  # Ctrl-C in a terminal, or a scheduler's preemption: the whole process group gets it
        os.killpg(driver.pid, signal.SIGINT if how.startswith("sigint") else signal.SIGTERM)
    _, err = driver.communicate(timeout=60)
    assert driver.returncode != 0
    assert "TrainingInterruptedError" in err and "TorchTrainer.restore(" in err, err
    assert how.split("-")[0].upper() in err

    run = manifest(path)
    assert run["status"] == "INTERRUPTED"
    # A SIGTERM is a preemption notice (its source and deadline kept); a SIGINT an interrupt.
    attempt = run["attempts"][0]
    if how.startswith("sigterm"):
        assert attempt["status"] == "PREEMPTED", "workers must not die on the signal"
        assert attempt["preempted"]["source"].startswith("SIGTERM") and attempt["preempted"]["ranks"] is None
        assert attempt["preempted"]["deadline"] == pytest.approx(attempt["preempted"]["received_at"] + 30)
    else:
        assert attempt["status"] == "INTERRUPTED", "workers must not die on the signal"
    rows = [json.loads(line) for line in open(os.path.join(path, "result.json"))]
    last = rows[-1]["training_iteration"]
    assert 4 <= last < ITERATIONS
    # The report that followed the signal carried the checkpoint: nothing recorded is lost.
    assert run["latest_checkpoint"] == commit.checkpoint_name(last)
    commit.verify(Storage.from_url(path), run["latest_checkpoint"], full=True)
    assert not os.path.exists(os.path.join(path, ".unbroken", "lease.json")), "lease released"

    out = run_script(RESTORE, path)
    assert f"DONE {ITERATIONS}" in out.stdout
    df = Result.from_path(path).metrics_dataframe
    assert list(df["training_iteration"]) == list(range(1, ITERATIONS + 1))
    rows = [json.loads(line) for line in open(os.path.join(path, "result.json"))]
    assert len(rows) == ITERATIONS, "no iteration was recorded twice: zero lost, zero redone"
    assert manifest(path)["attempts"][1]["resumed_from"] == commit.checkpoint_name(last)


def test_second_signal_stops_at_once_and_keeps_the_last_checkpoint(storage, tmp_path):
    name = "stopped-hard"
    path = os.path.join(storage, name)
    fifo = str(tmp_path / "never-written")
    os.mkfifo(fifo)
    # Rank 0 blocks after report 5, so the checkpoint the first signal asks for never comes.
    config = dict(CONFIG, ckpt_every=2, block_fifo=fifo, block_at=5)
    driver = start_script(DRIVER, storage, name, json.dumps(config))
    read_until(driver, "BLOCKING")
    driver.send_signal(signal.SIGTERM)
    for line in driver.stderr:
        if "preemption notice (SIGTERM)" in line:
            break
    driver.send_signal(signal.SIGTERM)
    _, err = driver.communicate(timeout=60)
    assert "TrainingInterruptedError" in err and "checkpoint_000004" in err, err

    run = manifest(path)
    assert run["status"] == "INTERRUPTED" and run["attempts"][0]["status"] == "INTERRUPTED"
    assert run["latest_checkpoint"] == "checkpoint_000004"
    commit.verify(Storage.from_url(path), "checkpoint_000004", full=True)

    # Amend the run on purpose (no more blocking) and finish it from checkpoint 4.
    result = TorchTrainer.restore(path, train_loop_config=dict(CONFIG, ckpt_every=2)).fit()
    assert result.metrics["training_iteration"] == ITERATIONS
    assert manifest(path)["attempts"][1]["resumed_from"] == "checkpoint_000004"


@pytest.mark.parametrize("how", ["blocked", "stopped"])
def test_hung_rank_is_detected_and_the_group_restarts(storage, tmp_path, how):
    """A rank blocked forever, or whose process is stopped (SIGSTOP: a frozen machine, which
    keeps its pipe open), is caught by hang_timeout_s; the stopped process is killed."""
    marker = str(tmp_path / "hung-pid")
    config = {"iterations": 8, "ckpt_every": 2, "hang_at": (5, 1), "hang_marker": marker,
              "hang_by_sigstop": how == "stopped"}
    trainer = TorchTrainer(linear_loop, train_loop_config=config, scaling_config=ScalingConfig(num_workers=2),
                           run_config=RunConfig(name="hung", storage_path=storage,
                                                failure_config=FailureConfig(max_failures=1,
                                                                             hang_timeout_s=4)))
    result = trainer.fit()
    assert result.metrics["training_iteration"] == 8
    run = manifest(result.path)
    first = run["attempts"][0]
    assert first["status"] == "ERRORED"
    assert "WorkerHangError" in first["error"] and "rank(s) [1] did not report iteration 5" in first["error"]
    assert run["attempts"][1]["resumed_from"] == "checkpoint_000004"
    # Where each rank was when the hang was called: the stuck rank in the loop's wait, the other
    # in the collective it waited in; a stopped process does not answer.
    assert first["hang"]["waited_for"] == [1]
    stacks = os.path.join(result.path, ".unbroken", "stacks", "attempt-001")
    if how == "blocked":
        at = first["hang"]["where"]["1"]
        assert at.startswith("loops.py:") and "in linear_loop" in at, at
        assert "linear_loop" in open(os.path.join(stacks, "rank-1.txt")).read()
    else:
        assert first["hang"]["where"]["1"] is None and not os.path.exists(os.path.join(stacks, "rank-1.txt"))
    assert "in linear_loop" in first["hang"]["where"]["0"], first["hang"]
    assert "Current thread" in open(os.path.join(stacks, "rank-0.txt")).read()
    hung = int(open(marker).read())
    with pytest.raises(ProcessLookupError):
        os.kill(hung, 0)  # gone, not left stopped (it was this process's child: reaped)

    reference = TorchTrainer(linear_loop, train_loop_config={"iterations": 8, "ckpt_every": 2},
                             scaling_config=ScalingConfig(num_workers=2),
                             run_config=RunConfig(name="reference", storage_path=storage)).fit()
    expected = final_weights(reference)
    for key, value in final_weights(result).items():
        assert torch.equal(value, expected[key])


@pytest.mark.slow  # 15 s; stopped ranks with hang_timeout_s are in the default run
def test_a_stopped_rank_without_hang_timeout_is_bounded_by_the_collective_timeout(storage, tmp_path):
    """Without hang_timeout_s, a rank whose process is stopped stalls its peers in their next
    collective until torch.distributed's timeout (TorchConfig(timeout_s=...)); then they fail
    and the group restarts, the stopped process killed with it (docs/guarantees.md)."""
    from unbroken.train.torch import TorchConfig

    marker = str(tmp_path / "stopped-pid")
    config = {"iterations": 6, "ckpt_every": 2, "hang_at": (3, 1), "hang_marker": marker,
              "hang_by_sigstop": True}
    result = TorchTrainer(linear_loop, train_loop_config=config, torch_config=TorchConfig(timeout_s=4),
                          scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(name="stopped", storage_path=storage, verbose=0,
                                               failure_config=FailureConfig(max_failures=1))).fit()
    assert result.metrics["training_iteration"] == 6
    first, second = manifest(result.path)["attempts"]
    assert "Timed out" in first["error"], first["error"]
    assert second["resumed_from"] == "checkpoint_000002"
    with pytest.raises(ProcessLookupError):
        os.kill(int(open(marker).read()), 0)


def test_hang_without_retries_fails_with_the_hang_named(storage):
    trainer = TorchTrainer(linear_loop, train_loop_config={"iterations": 4, "hang_at": (2, 1)},
                           scaling_config=ScalingConfig(num_workers=2),
                           run_config=RunConfig(name="hung-fails", storage_path=storage,
                                                failure_config=FailureConfig(hang_timeout_s=1)))
    from unbroken.train import TrainingFailedError

    with pytest.raises(TrainingFailedError, match="looks hung") as info:
        trainer.fit()
    assert "hang_timeout_s" in str(info.value.__cause__)
    assert manifest(os.path.join(storage, "hung-fails"))["status"] == "ERRORED"
