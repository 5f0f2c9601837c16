"""Ray Train V2 scripts on unbroken: the V2 report and checkpoint API, UserCallback, the V2
configs and Result, and V2's way to continue a run (re-running it), on real worker processes."""

import json
import logging
import os
import signal

import pytest

from conftest import read_until, run_json, run_script, start_script
from unbroken import train
from unbroken.cli import commands as cli
from unbroken.cli import inspection
from unbroken.errors import (
    CheckpointNameError,
    ControllerError,
    IdentityMismatchError,
    UnknownMetricError,
    UnsupportedAPIError,
    UnsupportedOptionError,
    WorkerGroupError,
)
from unbroken.train import (
    CheckpointConfig,
    CheckpointUploadMode,
    DataParallelTrainer,
    FailureConfig,
    Result,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
)
from v2_loops import Recorder, env_loop, epochs_loop, follow_loop, option_loop, shard_loop, torch_helpers_loop


def v2_trainer(loop, storage, name, config, **run):
    return DataParallelTrainer(loop, train_loop_config=config, scaling_config=ScalingConfig(num_workers=2),
                               run_config=RunConfig(name=name, storage_path=storage, **run))


def test_v2_imports(caplog):
    from unbroken.train.torch import TorchTrainer, prepare_data_loader, prepare_model  # noqa: F401

    for name in ("report", "get_context", "get_checkpoint", "get_dataset_shard", "Checkpoint",
                 "CheckpointUploadMode", "CheckpointConsistencyMode", "ReportedCheckpoint", "UserCallback",
                 "get_all_reported_checkpoints", "collective", "WorkerGroupError", "ControllerError",
                 "TrainingFailedError", "RunConfig", "ScalingConfig", "FailureConfig", "CheckpointConfig",
                 "Result", "ReportedCheckpointStatus"):
        assert hasattr(train, name), name
    assert issubclass(train.WorkerGroupError, TrainingFailedError)
    assert issubclass(train.ControllerError, TrainingFailedError)
    assert callable(train.collective.barrier)
    # V2's FailureConfig and ScalingConfig options are accepted; nonsense is not.
    FailureConfig(max_failures=1, controller_failure_limit=3, max_preemption_failures=0)
    ScalingConfig(num_workers=2, placement_strategy="SPREAD", accelerator_type="A100")
    # V1's trainer_resources: accepted with a warning (the driver takes no resources); V2's total.
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        scaling = ScalingConfig(num_workers=2, use_gpu=True, trainer_resources={"CPU": 1})
    assert "trainer_resources" in caplog.text and "no effect" in caplog.text
    assert scaling.total_resources == {"CPU": 2.0, "GPU": 2.0}
    assert ScalingConfig(num_workers=3, resources_per_worker={"CPU": 2}).total_resources == {"CPU": 6.0}
    with pytest.raises(ValueError, match="controller_failure_limit"):
        FailureConfig(controller_failure_limit=-2)
    with pytest.raises(UnsupportedOptionError, match="env_vars"):
        RunConfig(worker_runtime_env={"pip": ["requests"]})


def test_worker_runtime_env_vars_reach_the_workers(storage):
    result = DataParallelTrainer(env_loop, train_loop_config={"name": "V2_PORT_CHECK"},
                                 run_config=RunConfig(name="env", storage_path=storage, worker_runtime_env={
                                     "env_vars": {"V2_PORT_CHECK": "yes"}})).fit()
    assert result.return_value == "yes"


def test_custom_names_async_metric_only_reports_and_user_callback(storage, tmp_path):
    log = tmp_path / "callback.jsonl"
    result = v2_trainer(shard_loop, storage, "v2", {"epochs": 3},
                        callbacks=[Recorder(str(log))]).fit()
    run = os.path.join(storage, "v2")
    # Each custom name is one committed directory holding both ranks' shards, marker included.
    for epoch in (1, 2, 3):
        assert sorted(os.listdir(os.path.join(run, f"epoch_{epoch}"))) == [
            ".checkpoint.json", "shard_0.json", "shard_1.json"]
    assert not [n for n in os.listdir(run) if n.startswith("checkpoint_") or ".tmp-" in n]
    assert result.checkpoint.path == os.path.join(run, "epoch_3")
    df = result.metrics_dataframe
    assert list(df["training_iteration"]) == [1, 2, 3, 4, 5, 6]
    assert list(df["checkpoint_dir_name"].fillna("")) == ["", "epoch_1", "", "epoch_2", "", "epoch_3"]
    # ASYNC deleted each local directory once its files were staged; the loop's return value
    # (rank 0's) is the Result's, with what get_all_reported_checkpoints saw at the end.
    value = result.return_value
    assert value["kept_local"] == [False, False, False]
    assert value["reported"] == [["epoch_1", 2], ["epoch_2", 4], ["epoch_3", 6]]
    assert value["statuses"] == [train.ReportedCheckpointStatus.COMMITTED.value]  # V2 scripts read r.status
    assert value["storage"] == [storage, "v2", True]
    # Scores 2, 4, 1: the best by max is epoch_2, by min epoch_3.
    assert os.path.basename(result.get_best_checkpoint("score", "max").path) == "epoch_2"
    assert os.path.basename(result.get_best_checkpoint("score", "min").path) == "epoch_3"
    with pytest.raises(UnknownMetricError):
        result.get_best_checkpoint("nope", "max")
    assert Result.from_path(run).return_value == value
    # after_report: once per round, every rank's own metrics, the committed checkpoint.
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c["checkpoint"] for c in calls] == [None, "epoch_1", None, "epoch_2", None, "epoch_3"]
    assert all([m["rank"] for m in c["metrics"]] == [0, 1] for c in calls if c["checkpoint"] is None)
    assert "training_iteration" not in calls[0]["metrics"][0]


def test_sync_keeps_the_local_directory(storage):
    result = v2_trainer(shard_loop, storage, "sync", {"epochs": 2, "mode": "SYNC"}).fit()
    assert result.return_value["kept_local"] == [True, True]


def test_a_reused_checkpoint_name_is_refused_and_not_retried(storage, tmp_path):
    log = tmp_path / "callback.jsonl"
    trainer = v2_trainer(shard_loop, storage, "dup", {"epochs": 3, "name": "latest"},
                         failure_config=FailureConfig(max_failures=3), callbacks=[Recorder(str(log))])
    with pytest.raises(WorkerGroupError) as failed:
        trainer.fit()
    assert isinstance(failed.value.__cause__, CheckpointNameError)
    assert "already taken" in str(failed.value.__cause__)
    assert "f'epoch_{epoch}'" in str(failed.value.__cause__)  # the hint
    manifest = run_json(os.path.join(storage, "dup"))
    assert len(manifest["attempts"]) == 1  # a restart would give the same name again
    assert manifest["latest_checkpoint"] == "latest"
    # after_exception names the rank whose report raised.
    last = json.loads(log.read_text().splitlines()[-1])
    assert last["attempt"] == 1 and list(last["exception"].values()) == ["CheckpointNameError"]
    assert list(last["exception"]) in (["0"], ["1"])


def test_ranks_that_disagree_on_the_name_fail_the_run(storage):
    with pytest.raises(ControllerError) as failed:
        v2_trainer(shard_loop, storage, "disagree", {"epochs": 1, "name": "e{epoch}_r{rank}"}).fit()
    assert isinstance(failed.value.controller_failure, CheckpointNameError)
    assert "rank 0: 'e1_r0', rank 1: 'e1_r1'" in str(failed.value)


@pytest.mark.parametrize("name", ["checkpoint_000001", "../up", ".hidden", "a/b", "x.tmp-1", ""])
def test_names_that_cannot_name_a_checkpoint_directory(name):
    with pytest.raises(CheckpointNameError):
        train.report({}, checkpoint_dir_name=name)


@pytest.mark.parametrize("kwargs,hint", [
    ({"checkpoint_upload_mode": CheckpointUploadMode.NO_UPLOAD}, "SYNC"),
    ({"checkpoint_upload_fn": lambda c, d: c}, "storage_path"),
    ({"validate_fn": lambda c, cfg: {}}, "validation_config=ValidationConfig"),
    ({"validate_config": {}}, "validation=True"),
])
def test_v2_report_options_unbroken_does_not_support(kwargs, hint):
    # Checked before anything else, so a ported script fails at its first report.
    with pytest.raises(UnsupportedOptionError, match="Hint") as refused:
        train.report({}, **kwargs)
    assert hint in str(refused.value)


def test_an_unsupported_option_fails_the_run_with_its_own_error(storage):
    with pytest.raises(WorkerGroupError) as failed:
        v2_trainer(option_loop, storage, "noupload",
                   {"report": {"checkpoint_upload_mode": "NO_UPLOAD"}}).fit()
    assert isinstance(failed.value.__cause__, UnsupportedOptionError)
    assert set(failed.value.worker_failures) <= {0, 1}


def test_rerun_with_a_changed_config_continues_only_when_allowed(storage, capsys):
    def trainer(epochs, **run):
        return DataParallelTrainer(epochs_loop, train_loop_config={"epochs": epochs},
                                   run_config=RunConfig(name="extend", storage_path=storage, **run))

    assert trainer(2).fit().metrics["epoch"] == 2
    with pytest.raises(IdentityMismatchError) as refused:
        trainer(4).fit()
    message = str(refused.value)
    assert "train_loop_config.epochs: saved 2 -> now 4" in message
    hint = message.split("Hint:")[1]
    assert hint.index("allow_config_change=True") < hint.index("new name") < hint.index(".restore(")

    result = trainer(4, allow_config_change=True).fit()
    assert list(result.metrics_dataframe["epoch"]) == [1, 2, 3, 4]
    assert result.metrics["attempt"] == 2 and result.checkpoint.path.endswith("epoch_4")
    attempts = run_json(os.path.join(storage, "extend"))["attempts"]
    assert "config_change" not in attempts[0]
    assert attempts[1]["config_change"] == {"train_loop_config.epochs": {"saved": 2, "now": 4}}
    assert attempts[1]["resumed_from"] == "epoch_2"
    # The new configuration is the run's now: the same script again returns the stored result.
    assert trainer(4).fit().metrics["attempt"] == 2
    assert cli.main(["show", os.path.join(storage, "extend")]) == 0
    shown = capsys.readouterr().out
    assert "attempt 2 continued the run with a changed configuration" in shown
    assert "train_loop_config.epochs: saved 2 -> now 4" in shown


V2_SCRIPT = """
import os, sys, tempfile
import torch
from unbroken import train
from unbroken.train import (Checkpoint, CheckpointConfig, CheckpointUploadMode, FailureConfig,
                            RunConfig, ScalingConfig, UserCallback)
from unbroken.train.torch import TorchTrainer

STEPS = 3

class Log(UserCallback):
    def __init__(self, path):
        self.path = path

    def after_report(self, run_context, metrics, checkpoint):
        with open(self.path, "a") as f:
            f.write(f"{run_context.attempt} {metrics[0]['epoch']} {metrics[0]['step']} "
                    f"{os.path.basename(checkpoint.path) if checkpoint else '-'}\\n")

def train_fn(config):
    ctx = train.get_context()
    rank = ctx.get_world_rank()
    start, weight = 0, torch.zeros(4)
    checkpoint = train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, f"shard_{rank}.pt"), weights_only=True)
        start, weight = state["epoch"], state["weight"]
    for epoch in range(start + 1, config["epochs"] + 1):
        for step in range(STEPS):
            weight += rank + 1
            if os.environ.get("FAIL_AT") == f"{epoch}.{step}" and rank == 1:
                raise RuntimeError("injected")
            train.report({"epoch": epoch, "step": step, "w": float(weight.sum())})
        d = tempfile.mkdtemp()
        torch.save({"epoch": epoch, "weight": weight}, os.path.join(d, f"shard_{rank}.pt"))
        train.report({"epoch": epoch, "step": STEPS, "w": float(weight.sum())},
                     checkpoint=Checkpoint.from_directory(d), checkpoint_dir_name=f"epoch_{epoch}",
                     checkpoint_upload_mode=CheckpointUploadMode.ASYNC)
        if rank == 0:
            print("EPOCH", epoch, flush=True)
    return float(weight.sum())

storage, log = sys.argv[1], sys.argv[2]
trainer = TorchTrainer(
    train_fn, train_loop_config={"epochs": 5},
    scaling_config=ScalingConfig(num_workers=2),
    run_config=RunConfig(name="v2-script", storage_path=storage, callbacks=[Log(log)],
                         checkpoint_config=CheckpointConfig(num_to_keep=None),
                         failure_config=FailureConfig(max_failures=0, controller_failure_limit=-1)))
result = trainer.fit()
print("RESULT", result.return_value, os.path.basename(result.checkpoint.path))
"""


def test_v2_script_killed_then_failed_then_rerun_reports_each_round_once(storage, tmp_path):
    log = str(tmp_path / "after_report.log")
    run = os.path.join(storage, "v2-script")
    driver = start_script(V2_SCRIPT, storage, log)
    read_until(driver, "EPOCH 2")
    driver.send_signal(signal.SIGKILL)
    driver.wait()

    failed = run_script(V2_SCRIPT, storage, log, check=False, FAIL_AT="4.1")
    assert failed.returncode != 0 and "WorkerGroupError" in failed.stderr, failed.stderr[-2000:]

    done = run_script(V2_SCRIPT, storage, log)
    # 5 epochs of 3 metric-only reports and a checkpointed one; rank r adds r+1 per step to
    # each of 4 weights, so rank 0 ends at 15 * 4 = 60: the state went through every resume.
    assert "RESULT 60.0 epoch_5" in done.stdout
    result = Result.from_path(run)
    df = result.metrics_dataframe
    assert list(df["training_iteration"]) == list(range(1, 21))
    assert list(zip(df["epoch"], df["step"], strict=True)) == [(e, s) for e in range(1, 6) for s in range(4)]
    assert list(df["w"]) == [4.0 * ((e - 1) * 3 + min(s + 1, 3)) for e in range(1, 6) for s in range(4)]
    assert list(df["checkpoint_dir_name"].dropna()) == [f"epoch_{e}" for e in range(1, 6)]
    for e in range(1, 6):
        assert sorted(os.listdir(os.path.join(run, f"epoch_{e}"))) == [".checkpoint.json", "shard_0.pt",
                                                                        "shard_1.pt"]
    assert not [n for n in os.listdir(run) if ".tmp-" in n or ".del-" in n or n.startswith("checkpoint_")]
    statuses = [a["status"] for a in run_json(run)["attempts"]]
    assert statuses == ["ABORTED", "ERRORED", "FINISHED"]
    # The callback saw every round; rounds after the last commit of a stopped attempt again.
    # Except that a driver killed between a checkpoint's commit and the hook never calls it for
    # that round (which no attempt redoes): the kill lands right after report "EPOCH 2",
    # while epoch 1's or epoch 2's ASYNC checkpoint may be committing.
    seen = [line.split() for line in open(log).read().splitlines()]
    missed = {(e, s) for e in range(1, 6) for s in range(4)} - {(int(e), int(s)) for _, e, s, _ in seen}
    assert missed <= {(1, 3)} or missed <= {(2, 3)}, missed
    last = [(int(e), int(s), c) for a, e, s, c in seen if a == "3"]
    assert last[-1] == (5, 3, "epoch_5")


def test_custom_names_under_retention_and_a_corrupted_one_set_aside(storage, caplog):
    def trainer(epochs, keep):
        return DataParallelTrainer(epochs_loop, train_loop_config={"epochs": epochs},
                                   run_config=RunConfig(name="kept", storage_path=storage,
                                                        allow_config_change=True,
                                                        checkpoint_config=CheckpointConfig(num_to_keep=keep)))

    run = os.path.join(storage, "kept")
    trainer(3, keep=2).fit()
    assert sorted(n for n in os.listdir(run) if n.startswith("epoch_")) == ["epoch_2", "epoch_3"]
    with open(os.path.join(run, "epoch_3", "epoch"), "w") as f:
        f.write("X")  # same size, other bytes: the hash no longer matches
    result = trainer(4, keep=3).fit()
    # epoch_3 is set aside, the run resumes from epoch_2, and epoch_3 is written again.
    assert "epoch_3" in caplog.text and "torn or corrupted" in caplog.text
    assert sorted(n for n in os.listdir(run) if n.startswith("epoch_")) == [
        "epoch_2", "epoch_3", "epoch_3.corrupt-0", "epoch_4"]
    assert run_json(run)["attempts"][1]["resumed_from"] == "epoch_2"
    assert list(result.metrics_dataframe["epoch"]) == [1, 2, 3, 4]
    assert open(os.path.join(run, "epoch_3", "epoch")).read() == "3"
    states = {c.name: c.state for c in inspection.summarize(run).checkpoints}
    assert states["epoch_3.corrupt-0"] == inspection.QUARANTINED and states["epoch_4"] == inspection.COMMITTED


@pytest.mark.parametrize("module,name,hint", [
    ("unbroken.train", "DataConfig", "get_dataset_shard"),
    ("unbroken.train", "PreemptionError", "TrainingInterruptedError"),
    ("unbroken.train.torch", "accelerate", "torch.autocast"),
    ("unbroken.train.torch", "TorchXLAConfig", "TorchConfig"),
    ("unbroken.air", "session", "train.report(...)"),
    ("unbroken.air", "Checkpoint", "from unbroken.train import Checkpoint"),
])
def test_ray_names_unbroken_does_not_provide_say_what_instead(module, name, hint):
    with pytest.raises(UnsupportedAPIError, match="Hint") as refused:
        exec(f"from {module} import {name}")
    assert hint in str(refused.value) and isinstance(refused.value, ImportError)
    assert not hasattr(train, "no_such_name")
    assert train.TRAIN_DATASET_KEY == "train"


def test_torch_helpers_enable_reproducibility_and_get_devices(storage):
    def fit(name):
        return DataParallelTrainer(torch_helpers_loop, train_loop_config={"seed": 7},
                                   run_config=RunConfig(name=name, storage_path=storage)).fit()

    first, second = fit("repro-1"), fit("repro-2")
    assert first.metrics["deterministic"] is True
    assert first.return_value == second.return_value
    assert first.return_value[1] == ["cpu"]


S3_EPOCHS = """
import sys
from v2_loops import epochs_loop
from unbroken.train import DataParallelTrainer, Result, RunConfig, ScalingConfig
storage, epochs = sys.argv[1], int(sys.argv[2])
result = DataParallelTrainer(epochs_loop, train_loop_config={"epochs": epochs},
                             scaling_config=ScalingConfig(num_workers=2),
                             run_config=RunConfig(name="named", storage_path=storage,
                                                  allow_config_change=True)).fit()
print("DONE", result.checkpoint.path.rsplit("/", 1)[1],
      [c.path.rsplit("/", 1)[1] for c, _ in Result.from_path(result.url).checkpoints])
"""


@pytest.mark.slow  # 12 s; custom names are in the default run on local disk, object-store moves in test_s3
def test_custom_names_on_an_object_store(s3_endpoint):
    from conftest import s3_env

    storage = f"s3://bucket/{os.urandom(4).hex()}"
    first = run_script(S3_EPOCHS, storage, "2", **s3_env(s3_endpoint)).stdout
    assert "DONE epoch_2 ['epoch_1', 'epoch_2']" in first
    # A run continued on S3 finds its custom-named checkpoints by their markers.
    second = run_script(S3_EPOCHS, storage, "3", **s3_env(s3_endpoint)).stdout
    assert "DONE epoch_3 ['epoch_1', 'epoch_2', 'epoch_3']" in second


def test_options_v2_removed_stay_supported_for_v1_scripts(storage):
    def run_config(name, **kw):
        return RunConfig(name=name, storage_path=storage, **kw)

    stopped = DataParallelTrainer(epochs_loop, train_loop_config={"epochs": 5},
                                  run_config=run_config("stop", stop={"training_iteration": 2})).fit()
    assert stopped.metrics["epoch"] == 2
    started = DataParallelTrainer(epochs_loop, train_loop_config={"epochs": 3}, run_config=run_config("from"),
                                  resume_from_checkpoint=stopped.checkpoint).fit()
    assert list(started.metrics_dataframe["epoch"]) == [3]
    restored = DataParallelTrainer.restore(started.path, train_loop_config={"epochs": 4}).fit()
    assert list(restored.metrics_dataframe["epoch"]) == [3, 4]
    with pytest.raises(WorkerGroupError):
        DataParallelTrainer(option_loop, train_loop_config={"report": {"validation": True}},
                            run_config=run_config("fast", failure_config=FailureConfig(max_failures=3,
                                                                                        fail_fast=True))).fit()
    assert len(run_json(os.path.join(storage, "fast"))["attempts"]) == 1


# -- runs and sweeps without a name ------------------------------------------------------------
def test_two_trainers_without_a_name_in_the_same_second_each_run_their_own(storage, monkeypatch):
    """Ray's results example: a default name is `<Trainer>_<date to the second>`, so two trainers
    made in the same second shared a directory and the second fit() returned the first one's
    result, never raising its own error. A generated name is unique, and a run opened under one
    is always new: here the second trainer is even dealt the first one's name (the same random
    part too) and fit() picks another."""
    import secrets

    from loops import simple_loop

    drawn = iter(["aaaaaaaa", "aaaaaaaa", "bbbbbbbb"])
    monkeypatch.setattr(secrets, "token_hex", lambda n: next(drawn))
    first = DataParallelTrainer(simple_loop, train_loop_config={"iterations": 2},
                                run_config=RunConfig(storage_path=storage, verbose=0))
    second = DataParallelTrainer(simple_loop, train_loop_config={"iterations": 2, "fail_at": 1},
                                 run_config=RunConfig(storage_path=storage, verbose=0))
    assert first.run_config.name == second.run_config.name  # as Ray would name them in one second
    assert first.run_config.name.startswith("DataParallelTrainer_")
    done = first.fit()
    with pytest.raises(TrainingFailedError, match="injected failure at iteration 1"):
        second.fit()
    assert second.run_config.name.endswith("_bbbbbbbb") and done.path.endswith("_aaaaaaaa")
    assert sorted(os.listdir(storage)) == sorted([first.run_config.name, second.run_config.name])


def test_two_tuners_without_a_name_never_share_a_sweep(storage, monkeypatch):
    import secrets

    from tune_loops import tune_loop
    from unbroken import tune

    drawn = iter(["aaaaaaaa", "aaaaaaaa", "bbbbbbbb"])
    monkeypatch.setattr(secrets, "token_hex", lambda n: next(drawn))
    tuners = [tune.Tuner(tune_loop, param_space={"x": tune.grid_search([x])},
                         run_config=RunConfig(storage_path=storage, verbose=0)) for x in (1, 2)]
    grids = [t.fit() for t in tuners]
    assert [g[0].config["x"] for g in grids] == [1, 2], "each sweep ran its own trials"
    assert tuners[1].run_config.name.endswith("_bbbbbbbb")
    assert len(os.listdir(storage)) == 2


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_get_checkpoint_follows_the_latest_committed_checkpoint(storage, tmp_path, mode):
    """As in V2, train.get_checkpoint() after a report with a checkpoint returns it (once
    committed; an asynchronous save once its commit is known), not the one the attempt
    started from; a restored run starts from its latest. Every rank sees the same: rank 1,
    which saves nothing here, follows rank 0's checkpoints too (V2 keeps rank 1's own)."""
    config = {"iterations": 4, "dir": str(tmp_path), "async": mode == "async"}
    result = v2_trainer(follow_loop, storage, "follow", config).fit()
    expected = [None, None, "checkpoint_000002", "checkpoint_000002", "checkpoint_000004"]
    assert result.return_value["seen"] == expected
    rank1 = json.load(open(tmp_path / "rank1.json"))
    if mode == "sync":
        assert rank1 == expected  # the reply to each round names the checkpoint it committed
    else:  # rank 1 learns of rank 0's background commit when the driver's message reaches it
        seen = [name or "" for name in rank1]
        assert seen == sorted(seen) and all(a <= (b or "") for a, b in zip(seen, expected, strict=True))
    again = DataParallelTrainer.restore(result.path, train_loop_config=dict(config, iterations=2)).fit()
    assert again.return_value["seen"][0] == "checkpoint_000004"


def test_a_result_built_by_hand_ranks_its_best_checkpoints_and_checkpoints_print_as_in_ray(tmp_path):
    """Result(best_checkpoints=[...]) built by hand (as tests and tools do with Ray's): its
    get_best_checkpoint ranks those; and a Checkpoint prints as Ray's does."""
    from unbroken.train import Checkpoint

    a, b = Checkpoint(str(tmp_path / "a")), Checkpoint(str(tmp_path / "b"))
    result = Result(metrics={"loss": 1.0}, checkpoint=b, error=None, path=str(tmp_path),
                    best_checkpoints=[(a, {"loss": 0.5}), (b, {"loss": 1.0})])
    assert result.get_best_checkpoint("loss", "min") == a
    assert result.get_best_checkpoint("loss", "max") == b
    assert repr(a) == f"Checkpoint(filesystem=local, path={tmp_path / 'a'})"
