"""Worker failures within one fit(): retries from the latest checkpoint, or a clear error."""

import json
import os

import pytest
import torch

from loops import final_weights, linear_loop
from unbroken.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
from unbroken.train.torch import TorchTrainer


def fit(storage, name, max_failures=0, **config):
    config = {"iterations": 8, "ckpt_every": 2, **config}
    return TorchTrainer(linear_loop, train_loop_config=config,
                        scaling_config=ScalingConfig(num_workers=2),
                        run_config=RunConfig(name=name, storage_path=storage,
                                             failure_config=FailureConfig(max_failures=max_failures))).fit()


def test_worker_exception_is_retried_from_latest_checkpoint(storage):
    reference = fit(storage, "reference")
    result = fit(storage, "retried", max_failures=2, fail_at=(5, 1))
    manifest = json.load(open(os.path.join(result.path, ".unbroken", "run.json")))
    attempts = manifest["attempts"]
    assert [a["status"] for a in attempts] == ["ERRORED", "FINISHED"]
    assert "injected failure at iteration 5" in attempts[0]["error"]
    assert attempts[1]["resumed_from"] == "checkpoint_000004" and attempts[1]["resumed_iteration"] == 4
    df = result.metrics_dataframe
    assert list(df["training_iteration"]) == list(range(1, 9))
    assert list(df["attempt"]) == [1, 1, 1, 1, 2, 2, 2, 2]
    # As in Ray: counts the rows since the attempt (re)started, 1 for the first.
    assert list(df["iterations_since_restore"]) == [1, 2, 3, 4, 1, 2, 3, 4]
    assert df["time_since_restore"].iloc[4] < df["time_total_s"].iloc[4]
    assert "injected failure" in open(os.path.join(result.path, "error.txt")).read()
    # Resuming from a committed checkpoint gives exactly the uninterrupted weights.
    for key, value in final_weights(reference).items():
        assert torch.equal(value, final_weights(result)[key])


def test_without_retries_fit_raises_with_the_restore_call(storage):
    with pytest.raises(TrainingFailedError) as info:
        fit(storage, "noretry", fail_at=(3, 1))
    message = str(info.value)
    path = os.path.join(storage, "noretry")
    assert f"TorchTrainer.restore({path!r}).fit()" in message
    assert "injected failure at iteration 3" in message
    assert isinstance(info.value.__cause__, RuntimeError)
    manifest = json.load(open(os.path.join(path, ".unbroken", "run.json")))
    assert manifest["status"] == "ERRORED" and manifest["latest_checkpoint"] == "checkpoint_000002"
    # The run is restorable from where it stopped.
    restored = TorchTrainer.restore(path).fit()
    assert list(restored.metrics_dataframe["training_iteration"]) == list(range(1, 9))
    assert list(restored.metrics_dataframe["iterations_since_restore"]) == [1, 2, 1, 2, 3, 4, 5, 6]


def test_killed_worker_is_noticed_at_once_and_retried(storage, tmp_path):
    marker = tmp_path / "killed_at"
    result = fit(storage, "killed", max_failures=1, kill_worker_at=(3, 1), kill_marker=str(marker))
    manifest = json.load(open(os.path.join(result.path, ".unbroken", "run.json")))
    first = manifest["attempts"][0]
    assert first["status"] == "ERRORED" and "SIGKILL" in first["error"]
    # Noticed through the process sentinel, not a timeout (generous bound for a loaded machine).
    assert first["ended_at"] - float(marker.read_text()) < 2.0
    assert list(result.metrics_dataframe["training_iteration"]) == list(range(1, 9))


def test_killed_worker_without_retries_fails_the_run(storage):
    with pytest.raises(TrainingFailedError) as info:
        fit(storage, "killed-once", kill_worker_at=(3, 1))
    assert "worker rank 1" in str(info.value) and "SIGKILL" in str(info.value)


def test_unlimited_retries(storage):
    result = fit(storage, "unlimited", max_failures=-1, fail_at=(2, 1))
    assert result.metrics["training_iteration"] == 8


def stuck_rank_loop(config: dict) -> None:
    """Reports quickly; after report 3, rank 1 waits for ever outside any collective."""
    import threading

    from unbroken import train

    for i in range(1, 10):
        train.report({"i": i})
        if i == 3 and train.get_context().get_world_rank() == 1:
            threading.Event().wait()


def test_the_automatic_hang_bound_follows_the_run_s_rounds(storage, monkeypatch):
    # hang_timeout_s="auto" (the default): no bound before the second round, then 20 times
    # the longest time between rounds, never under AUTO_HANG_MIN_S (30 min; 1 s here).
    from unbroken.core import config as cfg

    auto = FailureConfig()
    assert auto.hang_timeout_s == "auto" and auto.hang_bound(None) is None
    assert auto.hang_bound(0.01) == cfg.AUTO_HANG_MIN_S == 1800
    assert auto.hang_bound(200.0) == 4000
    assert FailureConfig(hang_timeout_s=5).hang_bound(200.0) == 5
    assert FailureConfig(hang_timeout_s=None).hang_bound(200.0) is None
    with pytest.raises(ValueError, match="hang_timeout_s must be None, 'auto' or > 0"):
        FailureConfig(hang_timeout_s="soon")
    monkeypatch.setattr(cfg, "AUTO_HANG_MIN_S", 1.0)
    with pytest.raises(TrainingFailedError) as info:
        TorchTrainer(stuck_rank_loop, scaling_config=ScalingConfig(num_workers=2),
                     run_config=RunConfig(name="stuck", storage_path=storage)).fit()
    assert "rank(s) [1] did not report iteration 4 within 1 s" in str(info.value)


def test_round_gaps_keep_the_longest_time_between_two_rounds():
    from unbroken.execution.attempt_loop import RoundGaps

    gaps = RoundGaps()
    gaps.completed(10.0)
    assert gaps.longest is None, "one round: no gap yet"
    for now in (10.5, 12.5, 13.0):
        gaps.completed(now)
    assert gaps.longest == 2.0
