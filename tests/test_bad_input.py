"""SPEC section 8, one test per case: each bad input gets an error of a specific type whose
message names the problem and the fix, and nothing already stored changes."""

import hashlib
import json
import os
import shutil
import stat

import pytest

from loops import simple_loop
from unbroken.errors import (
    CorruptRunError,
    InsufficientResourcesError,
    LeaseHeldError,
    MetricsNotSerializableError,
    ReportMismatchError,
    RestoreArgumentError,
    RunExistsError,
    RunNotFoundError,
    SchemaVersionError,
    StorageError,
    TrainerClassMismatchError,
    UnknownOverrideError,
)
from unbroken.train import DataParallelTrainer, RunConfig, ScalingConfig, TrainingFailedError
from unbroken.train.torch import TorchTrainer


def snapshot(root: str) -> dict[str, str]:
    """Every file under `root` with a hash of its bytes (the whole stored state)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            full = os.path.join(dirpath, name)
            out[os.path.relpath(full, root)] = hashlib.sha256(open(full, "rb").read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def stored_runs(tmp_path_factory):
    """Real runs made once: an errored 2-worker run with checkpoints, and one with a dataset."""
    storage = str(tmp_path_factory.mktemp("stored"))
    with pytest.raises(TrainingFailedError):
        DataParallelTrainer(simple_loop, train_loop_config={"iterations": 6, "fail_at": 4},
                            scaling_config=ScalingConfig(num_workers=2),
                            run_config=RunConfig(name="errored", storage_path=storage)).fit()
    DataParallelTrainer(simple_loop, datasets={"train": [1, 2, 3]},
                        run_config=RunConfig(name="with-data", storage_path=storage)).fit()
    return storage


@pytest.fixture
def run(stored_runs, tmp_path):
    """A private copy of the errored run."""
    path = str(tmp_path / "errored")
    shutil.copytree(os.path.join(stored_runs, "errored"), path)
    return path


def assert_clear(info, *needles: str) -> None:
    message = str(info.value)
    assert "Hint" in message, message
    for needle in needles:
        assert needle in message, message


def test_nonexistent_path(tmp_path):
    path = str(tmp_path / "no-such-run")
    with pytest.raises(RunNotFoundError) as info:
        DataParallelTrainer.restore(path)
    assert_clear(info, "does not exist", "<storage_path>/<name>")
    assert not DataParallelTrainer.can_restore(path)
    assert not os.path.exists(path)


def test_a_file_instead_of_a_run_directory(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("not a run")
    with pytest.raises(RunNotFoundError) as info:
        DataParallelTrainer.restore(str(path))
    assert_clear(info, "is a file")
    assert path.read_text() == "not a run"


def test_an_empty_directory(tmp_path):
    path = tmp_path / "empty"
    path.mkdir()
    with pytest.raises(RunNotFoundError) as info:
        DataParallelTrainer.restore(str(path))
    assert_clear(info, "run.json")
    assert os.listdir(path) == []


def test_a_half_written_run_directory(run):
    for name in ("run.json", "run.prev.json"):  # killed before its manifest was written
        os.remove(os.path.join(run, ".unbroken", name))
    before = snapshot(run)
    with pytest.raises(RunNotFoundError) as info:
        DataParallelTrainer.restore(run)
    assert_clear(info, "run.json")
    storage, name = os.path.split(run)
    with pytest.raises(RunExistsError) as info:  # and a fit() there does not overwrite it
        DataParallelTrainer(simple_loop, run_config=RunConfig(name=name, storage_path=storage)).fit()
    assert_clear(info, "not an unbroken run", "left untouched")
    assert snapshot(run) == before


def test_corrupted_and_truncated_run_json(run):
    meta = os.path.join(run, ".unbroken")
    with open(os.path.join(meta, "run.json"), "r+b") as f:
        f.truncate(40)
    with open(os.path.join(meta, "run.prev.json"), "wb") as f:
        f.write(b"\x00garbage{")
    before = snapshot(run)
    with pytest.raises(CorruptRunError) as info:
        DataParallelTrainer.restore(run)
    assert_clear(info, "run.json is corrupted", "run.prev.json is corrupted", "checkpoints")
    assert not DataParallelTrainer.can_restore(run)
    assert snapshot(run) == before


def test_every_checkpoint_torn_or_bit_flipped(run):
    names = sorted(n for n in os.listdir(run) if n.startswith("checkpoint_"))
    assert len(names) >= 2
    for name in names:
        with open(os.path.join(run, name, "it.txt"), "r+b") as f:
            byte = f.read(1)
            f.seek(0)
            f.write(bytes([byte[0] ^ 0x01]))
    before = snapshot(run)
    with pytest.raises(CorruptRunError) as info:
        DataParallelTrainer.restore(run).fit()
    assert_clear(info, names[-1], "does not match its hash", "unbroken verify")
    assert snapshot(run) == before


def test_a_run_written_by_a_newer_schema(run):
    for name in ("run.json", "run.prev.json"):
        path = os.path.join(run, ".unbroken", name)
        manifest = json.load(open(path))
        manifest["schema_version"] = 999
        json.dump(manifest, open(path, "w"))
    before = snapshot(run)
    with pytest.raises(SchemaVersionError) as info:
        DataParallelTrainer.restore(run)
    assert_clear(info, "schema 999", "upgrade unbroken")
    assert snapshot(run) == before


def test_a_missing_respecified_argument(stored_runs):
    path = os.path.join(stored_runs, "with-data")
    before = snapshot(path)
    with pytest.raises(RestoreArgumentError) as info:
        DataParallelTrainer.restore(path)
    assert_clear(info, "'datasets'", f"DataParallelTrainer.restore({path!r}, datasets={{'train': ...}})")
    assert snapshot(path) == before


def test_an_unknown_override(run):
    before = snapshot(run)
    with pytest.raises(UnknownOverrideError) as info:
        DataParallelTrainer.restore(run, learning_rate=0.1)
    assert_clear(info, "learning_rate", "train_loop_config")
    assert snapshot(run) == before


def test_the_wrong_trainer_class(run):
    before = snapshot(run)
    with pytest.raises(TrainerClassMismatchError) as info:
        TorchTrainer.restore(run)
    assert_clear(info, "DataParallelTrainer", "BaseTrainer.restore")
    assert snapshot(run) == before


def test_a_second_driver(run):
    from unbroken.store.lease import _process_start

    lease = os.path.join(run, ".unbroken", "lease.json")
    with open(lease, "w") as f:  # a live driver: this very process, under another lease token
        json.dump({"token": "other", "host": os.uname().nodename, "pid": os.getpid(),
                   "process_start": _process_start(os.getpid()), "heartbeat": 0, "ttl_s": 30}, f)
    before = snapshot(run)
    with pytest.raises(LeaseHeldError) as info:
        DataParallelTrainer.restore(run).fit()
    assert_clear(info, f"pid {os.getpid()}")
    assert snapshot(run) == before


def test_a_storage_url_whose_filesystem_is_not_installed():
    pytest.importorskip("fsspec")
    if shutil.which("gcsfs") or _installed("gcsfs"):
        pytest.skip("gcsfs is installed here")
    with pytest.raises(StorageError) as info:
        DataParallelTrainer(simple_loop, run_config=RunConfig(name="r", storage_path="gs://bucket/runs")).fit()
    assert_clear(info, "gs://", "pip install gcsfs")


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_unwritable_storage(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(StorageError) as info:  # a storage path below a file: never writable
        DataParallelTrainer(simple_loop, run_config=RunConfig(name="r", storage_path=str(blocker))).fit()
    assert_clear(info, "cannot write", "storage_path")
    if os.geteuid() != 0:  # root ignores permission bits
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
        try:
            config = RunConfig(name="r", storage_path=str(locked))
            with pytest.raises(StorageError) as info:
                DataParallelTrainer(simple_loop, run_config=config).fit()
            assert_clear(info, "cannot write")
        finally:
            locked.chmod(stat.S_IRWXU)
        assert os.listdir(locked) == []


def committed_state(run: str) -> dict[str, str]:
    """What an attempt must never change: committed checkpoints and the rows already recorded."""
    state = {k: v for k, v in snapshot(run).items() if k.startswith("checkpoint_")}
    state["rows"] = open(os.path.join(run, "result.json")).read()
    return state


def assert_kept(before: dict[str, str], after: dict[str, str]) -> None:
    assert after.pop("rows").startswith(before.pop("rows")), "recorded rows are kept"
    assert {k: after.get(k) for k in before} == before, "committed checkpoints are kept"


def test_metrics_that_are_not_json_serializable(run):
    before = committed_state(run)
    with pytest.raises(TrainingFailedError) as info:
        DataParallelTrainer.restore(run, train_loop_config={"iterations": 6, "bad_metric": True}).fit()
    cause = info.value.__cause__
    assert isinstance(cause, MetricsNotSerializableError)
    assert "'loss'" in str(cause) and "loss.item()" in str(cause)
    assert_kept(before, committed_state(run))


def test_report_called_by_some_ranks_only(run):
    before = committed_state(run)
    with pytest.raises(TrainingFailedError) as info:
        DataParallelTrainer.restore(run, train_loop_config={"iterations": 6, "uneven": True}).fit()
    cause = info.value.__cause__
    assert isinstance(cause, ReportMismatchError)
    assert "different number of times" in str(cause) and "Hint" in str(cause)
    assert_kept(before, committed_state(run))


def test_use_gpu_where_no_gpu_is_visible(run, tmp_path):
    from unbroken.execution.engine.local import visible_gpus

    if visible_gpus()[0] > 0:
        pytest.skip("this machine has a GPU")
    storage = str(tmp_path / "fresh")
    with pytest.raises(InsufficientResourcesError) as info:
        TorchTrainer(simple_loop, scaling_config=ScalingConfig(num_workers=2, use_gpu=True),
                     run_config=RunConfig(name="gpu", storage_path=storage)).fit()
    assert_clear(info, "no GPU is visible", "device_count()", "use_gpu=False")
    assert not os.path.exists(storage), "refused before anything was written"
    before = snapshot(run)
    with pytest.raises(InsufficientResourcesError):
        DataParallelTrainer.restore(run, scaling_config=ScalingConfig(use_gpu=True)).fit()
    assert snapshot(run) == before
    from unbroken.tune import Tuner, grid_search

    gpu_trainer = DataParallelTrainer(simple_loop, scaling_config=ScalingConfig(use_gpu=True))
    with pytest.raises(InsufficientResourcesError):
        Tuner(gpu_trainer, param_space={"train_loop_config": {"iterations": grid_search([1, 2])}},
              run_config=RunConfig(name="gpu-sweep", storage_path=storage)).fit()
    assert not os.path.exists(storage), "a sweep is refused before anything is written too"


@pytest.mark.parametrize("name,hint", [
    ("ResourceChangingScheduler", "scaling_config"),
    ("HyperBandForBOHB", "HyperBandScheduler"),
])
def test_ray_tune_schedulers_unbroken_does_not_provide_say_what_instead(name, hint):
    from unbroken.errors import UnsupportedAPIError

    with pytest.raises(UnsupportedAPIError, match="Hint") as refused:
        exec(f"from unbroken.tune.schedulers import {name}")
    assert hint in str(refused.value) and "Ray Tune" in str(refused.value)


def test_ray_tune_scheduler_module_paths_import():
    from unbroken.tune import schedulers
    from unbroken.tune.schedulers.async_hyperband import ASHAScheduler, AsyncHyperBandScheduler
    from unbroken.tune.schedulers.hyperband import HyperBandScheduler
    from unbroken.tune.schedulers.pbt import PopulationBasedTraining

    assert ASHAScheduler is AsyncHyperBandScheduler is schedulers.ASHAScheduler
    assert HyperBandScheduler is schedulers.HyperBandScheduler
    assert PopulationBasedTraining is schedulers.PopulationBasedTraining


@pytest.mark.parametrize("statement,hint", [
    ("from unbroken.tune import run", "tune.Tuner("),
    ("from unbroken.tune import ExperimentAnalysis", "get_results()"),
    ("from unbroken.tune import CLIReporter", "tune.Callback"),
    ("from unbroken.tune.search import HyperOptSearch", "OptunaSearch"),
    ("from unbroken.tune.logger import TBXLoggerCallback", "LoggerCallback"),
    # Ray's module paths that hold nothing unbroken provides refuse when imported.
    ("from unbroken.tune.schedulers.hb_bohb import HyperBandForBOHB", "HyperBandScheduler"),
    ("import unbroken.tune.schedulers.hb_bohb", "HyperBandScheduler"),
    ("from unbroken.tune.integration.lightgbm import TuneReportCheckpointCallback", "tune.report("),
    ("from unbroken.tune.integration.xgboost import TuneReportCheckpointCallback", "TrainingCallback"),
    ("from unbroken.tune.integration.keras import TuneReportCheckpointCallback", "on_epoch_end"),
    ("from unbroken.tune.integration.pytorch_lightning import TuneReportCallback",
     "unbroken.train.lightning.RayTrainReportCallback"),
    ("from unbroken.tune.integration import pytorch_lightning", "RayTrainReportCallback"),
    ("from unbroken.tune.syncer import SyncConfig", "RunConfig(storage_path='s3://"),
    ("from unbroken.tune.execution.placement_groups import PlacementGroupFactory", "tune.with_resources("),
    ("from unbroken.air.integrations.mlflow import MLflowLoggerCallback, setup_mlflow",
     "from unbroken.train import MLflowLoggerCallback"),
    ("from unbroken.air.integrations.wandb import WandbLoggerCallback, setup_wandb",
     "from unbroken.train import WandbLoggerCallback"),
    ("from unbroken.air.integrations import wandb", "WandbLoggerCallback"),
    ("from unbroken.tune.execution.tune_controller import TuneController", "tune.Tuner"),
])
def test_ray_tune_names_without_a_counterpart_say_what_instead(statement, hint):
    from unbroken.errors import UnsupportedAPIError

    with pytest.raises(UnsupportedAPIError, match="Hint") as refused:
        exec(statement)
    library = "Ray AIR" if "unbroken.air" in statement else "Ray Tune"
    assert hint in str(refused.value) and library in str(refused.value)
    from unbroken.tune import stopper  # noqa: F401 - a submodule is still found past __getattr__
