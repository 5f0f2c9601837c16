"""Asynchronous checkpoint validation (Ray Train V2's ValidationConfig) on real worker and
validation processes: statuses, merged metrics, retention, failures, timeouts, and a driver
killed while a validation is in flight."""

import json
import os
import signal

import pytest

from conftest import read_until, run_script, start_script
from unbroken import cli, train
from unbroken.train import (
    CheckpointConfig,
    DataParallelTrainer,
    Result,
    RunConfig,
    ScalingConfig,
    ValidationConfig,
    ValidationTaskConfig,
)
from validation_loops import validate, validation_loop


def trainer(storage, name, config, validation=None, **checkpoint):
    return DataParallelTrainer(validation_loop, train_loop_config=config,
                               scaling_config=ScalingConfig(num_workers=2),
                               validation_config=validation,
                               run_config=RunConfig(name=name, storage_path=storage,
                                                    checkpoint_config=CheckpointConfig(**checkpoint)))


def test_validated_metrics_merge_into_the_checkpoints_and_rank_them(storage, capsys):
    config = {"iterations": 4, "asks": {"2": "yes", "3": "kwargs", "4": "yes"}}
    validation = ValidationConfig(validate, task_config=ValidationTaskConfig(fn_kwargs={"scale": 2}))
    result = trainer(storage, "merged", config, validation, num_to_keep=2,
                     checkpoint_score_attribute="val", checkpoint_score_order="max").fit()
    # What the loop saw at its end (VALIDATED: every validation asked for so far had ended).
    seen = {name: (status, val, loss) for name, status, val, loss in result.return_value}
    assert seen["checkpoint_000003"] == ("VALIDATED", 300, -3)  # the report's fn_kwargs win
    assert seen["checkpoint_000004"] == ("VALIDATED", 8, -4)  # validated keys overwrite reported ones
    # Retention ranks by the validated score: the two best "val" are kept (3, then 4 at 8).
    kept = sorted(n for n in os.listdir(result.path) if n.startswith("checkpoint_"))
    assert kept == ["checkpoint_000003", "checkpoint_000004"]
    assert [c.path.rsplit("/", 1)[1] for c, _ in result.best_checkpoints] == ["checkpoint_000004",
                                                                              "checkpoint_000003"]
    assert result.best_checkpoints[-1][1]["val"] == 300
    assert result.get_best_checkpoint("val", "max").path.endswith("checkpoint_000003")
    assert result.metrics["loss"] == 0.25, "the metric history keeps what was reported"
    cli.main(["show", result.url])
    out = capsys.readouterr().out
    assert "VALIDATION" in out and "VALIDATED loss=-3 val=300" in out


def test_a_failed_or_timed_out_validation_is_recorded_and_training_goes_on(storage, capsys):
    config = {"iterations": 3, "asks": {"1": "yes", "2": "yes", "3": "yes"}}
    validation = ValidationConfig(validate, task_config=ValidationTaskConfig(
        fn_kwargs={"fail_at": 1, "block_at": 2}, timeout_s=2.0))
    blocker = os.path.join(os.path.dirname(storage), "block")
    os.mkfifo(blocker)
    os.environ["UNBROKEN_TEST_BLOCK"] = blocker  # inherited by the validation processes
    try:
        result = trainer(storage, "failing", config, validation).fit()
    finally:
        del os.environ["UNBROKEN_TEST_BLOCK"]
    seen = {name: status for name, status, _, _ in result.return_value}
    assert seen == {"checkpoint_000001": "VALIDATION_FAILED", "checkpoint_000002": "VALIDATION_TIMEOUT",
                    "checkpoint_000003": "VALIDATED"}
    assert result.metrics["i"] == 3 and result.error is None
    record = json.load(open(os.path.join(result.path, ".unbroken", "validations", "checkpoint_000001.json")))
    assert "validation refuses value 1" in record["error"]
    cli.main(["show", result.path])
    assert "VALIDATION_FAILED: ValueError: validation refuses value 1" in capsys.readouterr().out


def test_committed_mode_does_not_wait_for_a_validation(storage):
    blocker = os.path.join(os.path.dirname(storage), "block")
    os.mkfifo(blocker)
    os.environ["UNBROKEN_TEST_BLOCK"] = blocker
    validation = ValidationConfig(validate, task_config=ValidationTaskConfig(fn_kwargs={"block_at": 2},
                                                                            timeout_s=3.0))
    try:
        result = trainer(storage, "committed", {"iterations": 2, "asks": {"2": "yes"}, "mode": "COMMITTED"},
                         validation).fit()
    finally:
        del os.environ["UNBROKEN_TEST_BLOCK"]
    # The loop did not wait for the validation that blocks; fit() did, until its timeout.
    seen = {name: status for name, status, _, _ in result.return_value}
    assert seen == {"checkpoint_000001": "COMMITTED", "checkpoint_000002": "PENDING_VALIDATION"}
    assert Result.from_path(result.path).best_checkpoints[-1][1]["loss"] == 0.5  # not validated: as reported


DRIVER = """
import sys
from validation_loops import validate, validation_loop
from unbroken.train import (CheckpointConfig, DataParallelTrainer, RunConfig, ScalingConfig,
                            ValidationConfig, ValidationTaskConfig)
storage, name = sys.argv[1], sys.argv[2]
trainer = DataParallelTrainer(
    validation_loop, train_loop_config={"iterations": 4, "asks": {"2": "yes"}},
    scaling_config=ScalingConfig(num_workers=2),
    validation_config=ValidationConfig(validate, task_config=ValidationTaskConfig(fn_kwargs={"block_at": 2})),
    run_config=RunConfig(name=name, storage_path=storage, checkpoint_config=CheckpointConfig(
        num_to_keep=2, checkpoint_score_attribute="val", checkpoint_score_order="max")))
result = trainer.fit()
print("DONE", result.return_value, flush=True)
"""


def test_a_validation_in_flight_when_the_driver_dies_runs_again_and_is_recorded_once(storage, tmp_path):
    blocker = str(tmp_path / "block")
    os.mkfifo(blocker)
    driver = start_script(DRIVER, storage, "killed", UNBROKEN_TEST_BLOCK=blocker)
    read_until(driver, "VALIDATING checkpoint_000002")
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    run = os.path.join(storage, "killed")
    # Retention never deletes a checkpoint whose validation is pending (until validated, no
    # checkpoint has a "val" to rank it, and only the latest would be kept).
    assert os.path.isdir(os.path.join(run, "checkpoint_000002"))
    assert not os.path.exists(os.path.join(run, ".unbroken", "validations", "checkpoint_000002.json"))
    out = run_script(DRIVER, storage, "killed").stdout
    assert out.count("VALIDATING checkpoint_000002") == 1 and "DONE" in out
    record = json.load(open(os.path.join(run, ".unbroken", "validations", "checkpoint_000002.json")))
    assert record["status"] == "VALIDATED" and record["metrics"] == {"val": 2, "loss": -2}
    # Validated, it is kept for its score, with the latest; the rest went.
    assert sorted(n for n in os.listdir(run) if n.startswith("checkpoint_")) == ["checkpoint_000002",
                                                                                 "checkpoint_000004"]
    # A third fit() returns the finished run; nothing is validated again.
    again = run_script(DRIVER, storage, "killed").stdout
    assert "VALIDATING" not in again


def no_checkpoint_loop(config):
    train.report({"i": 1}, validation=True)


def test_asking_without_a_checkpoint_or_without_a_validation_config_says_what_to_do(storage):
    from unbroken.train import TrainingFailedError

    with pytest.raises(TrainingFailedError, match="needs the trainer's ValidationConfig"):
        trainer(storage, "no-config", {"iterations": 1, "asks": {"1": "yes"}}).fit()
    with pytest.raises(TrainingFailedError, match="this report has none. Hint"):
        DataParallelTrainer(no_checkpoint_loop, validation_config=ValidationConfig(validate),
                            run_config=RunConfig(name="no-checkpoint", storage_path=storage)).fit()
