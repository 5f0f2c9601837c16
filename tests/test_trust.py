"""Reading a run never runs code you did not ask for (issue 11, item 8).

Every non-JSON file in the metadata of real runs and sweeps is replaced by a pickle that
creates a marker file when it is unpickled. Listing, showing, verifying, reading results,
`can_restore`, auto-resume and a restore that re-specifies every pickled argument must
never create the marker; `allow_pickle=False` refuses, before unpickling anything, with the
arguments to re-specify. A control proves that the planted pickle does create the marker
when it is unpickled, and that restore reads exactly those files when it is let to.
"""

import json
import os
import pickle
import shutil
import subprocess
import sys
import urllib.parse

import pytest

from conftest import S3_CREDENTIALS, driver_env, run_script, s3_env
from test_restore import MAIN_TRAINER
from unbroken.errors import PickleRefusedError, RestoreArgumentError
from unbroken.train import BaseTrainer, DataParallelTrainer, Result, RunConfig, TrainingFailedError
from unbroken.train.torch import TorchTrainer
from unbroken.tune import Tuner


class Opaque:
    """A value that is not JSON, so the argument holding it is pickled."""

    def __init__(self, tag: str) -> None:
        self.tag = tag


class _Plant:
    """Unpickling this opens `path` for writing: it creates the marker file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def closure_loop():
    """A training function that is not importable by name, so it is pickled by value."""

    def loop(config):
        from toy_loops import toy_loop

        toy_loop(config)

    return loop


def closure_trainable():
    def trainable(config):
        from tune_loops import tune_loop

        tune_loop(config)

    return trainable


@pytest.fixture
def marker(tmp_path):
    """(marker path, planted pickle bytes); the control: unpickling the bytes creates the file."""
    path = tmp_path / "UNPICKLED"
    planted = pickle.dumps(_Plant(str(path)))
    pickle.loads(planted).close()
    assert path.exists(), "the planted pickle must create the marker when unpickled"
    path.unlink()
    return path, planted


def assert_reads_planted(path, planted, marker_path, restore):
    """Control: `restore()`, which must load the stored arguments, reads the planted files
    (so the test's "never unpickled" checks can fail)."""
    plant(path, planted)
    try:
        restore()
    except Exception:  # noqa: BLE001 - what was unpickled is a file object, not what was saved
        pass
    assert marker_path.exists(), "restore did not read the planted files: the test proves nothing"


def plant(root, planted, extra=("trainer.pkl", "tuner.pkl", "pickled/__trainer_class__.pkl")):
    """Overwrite every non-JSON file under every .unbroken/ below `root` with `planted`, and add
    `extra` files (other places a reader could look) there. Returns the files overwritten."""
    overwritten = []
    metas = [d for d, _, _ in os.walk(root) if os.path.basename(d) == ".unbroken"]
    for meta in metas:
        for dirpath, _, filenames in os.walk(meta):
            for name in filenames:
                if not name.endswith(".json") and name != "lease.lock":  # empty; never read
                    full = os.path.join(dirpath, name)
                    open(full, "wb").write(planted)
                    overwritten.append(os.path.relpath(full, root))
        for rel in extra:
            os.makedirs(os.path.dirname(os.path.join(meta, rel)), exist_ok=True)
            open(os.path.join(meta, rel), "wb").write(planted)
    return sorted(overwritten)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "unbroken", *args], env=driver_env(), capture_output=True,
                          text=True, timeout=120)


def crashed_run(storage, name, tag="a"):
    """An ERRORED run whose train_loop_per_worker and train_loop_config are pickled."""
    config = {"iterations": 4, "fail_at": [[3, 1]], "ckpt_every": 2, "obj": Opaque(tag)}
    with pytest.raises(TrainingFailedError):
        DataParallelTrainer(closure_loop(), train_loop_config=config,
                            run_config=RunConfig(name=name, storage_path=storage, verbose=0)).fit()
    path = os.path.join(storage, name)
    assert run_json(path)["pickled_params"] == ["train_loop_config", "train_loop_per_worker"]
    return path


def run_json(path):
    return json.load(open(os.path.join(path, ".unbroken", "run.json")))


def new_config(tag="b"):
    return {"iterations": 4, "ckpt_every": 2, "obj": Opaque(tag)}


def test_pickled_arguments_are_one_file_each(storage):
    path = crashed_run(storage, "layout")
    meta = os.path.join(path, ".unbroken")
    assert sorted(os.listdir(meta)) == ["lease.lock", "pickled", "run.json", "run.prev.json"]
    assert sorted(os.listdir(os.path.join(meta, "pickled"))) == ["train_loop_config.pkl",
                                                                 "train_loop_per_worker.pkl"]
    assert run_json(path)["schema_version"] == 2
    # An argument that is plain data on the next attempt is no longer read from a pickle; its file
    # stays while a manifest on storage may still name it, and goes at the next open of the run.
    DataParallelTrainer.restore(path, train_loop_config={"iterations": 4, "ckpt_every": 2}).fit()
    assert run_json(path)["pickled_params"] == ["train_loop_per_worker"]
    DataParallelTrainer.restore(path, train_loop_config={"iterations": 5, "ckpt_every": 2}).fit()
    assert os.listdir(os.path.join(meta, "pickled")) == ["train_loop_per_worker.pkl"]


def test_readers_never_unpickle_and_allow_pickle_false_refuses(storage, marker):
    marker_path, planted = marker
    path = crashed_run(storage, "planted")
    assert plant(path, planted) == [".unbroken/pickled/train_loop_config.pkl",
                                    ".unbroken/pickled/train_loop_per_worker.pkl"]

    # The command line, as a user runs it.
    for args in (["ls", storage], ["show", path], ["show", "--json", path], ["verify", path]):
        out = cli(*args)
        assert out.returncode == 0, (args, out.stdout, out.stderr)
        assert not marker_path.exists(), f"unbroken {' '.join(args)} unpickled something"
    # The Python readers.
    result = Result.from_path(path)
    assert result.status == "ERRORED" and result.checkpoint is not None
    assert DataParallelTrainer.can_restore(path) and BaseTrainer.can_restore(path)
    assert not TorchTrainer.can_restore(path)
    assert not marker_path.exists()

    # allow_pickle=False refuses before unpickling anything, naming what to re-specify.
    with pytest.raises(PickleRefusedError) as info:
        DataParallelTrainer.restore(path, allow_pickle=False)
    message = str(info.value)
    assert isinstance(info.value, RestoreArgumentError) and isinstance(info.value, ValueError)
    assert "'train_loop_config'" in message and "'train_loop_per_worker'" in message
    assert (f"DataParallelTrainer.restore({path!r}, allow_pickle=False, train_loop_config=..., "
            "train_loop_per_worker=...)") in message
    with pytest.raises(PickleRefusedError) as info:
        BaseTrainer.restore(path, allow_pickle=False, train_loop_per_worker=closure_loop())
    assert "'train_loop_config'" in str(info.value) and "'train_loop_per_worker'" not in str(info.value)
    assert not marker_path.exists()

    # A restore that re-specifies every pickled argument never reads them, and its fit() neither.
    trainer = DataParallelTrainer.restore(path, train_loop_per_worker=closure_loop(),
                                          train_loop_config=new_config())
    assert trainer.train_loop_config["obj"].tag == "b"
    result = trainer.fit()
    assert result.status == "FINISHED"
    assert list(result.metrics_dataframe["training_iteration"]) == [1, 2, 3, 4]
    assert not marker_path.exists()

    # The same with allow_pickle=False (a finished run restored with overrides continues).
    plant(path, planted)
    trainer = DataParallelTrainer.restore(path, allow_pickle=False, train_loop_per_worker=closure_loop(),
                                          train_loop_config={**new_config("c"), "iterations": 5})
    assert trainer.fit().metrics["training_iteration"] == 5
    assert not marker_path.exists()

    # Control: a restore that must load the stored arguments reads exactly the planted files.
    assert_reads_planted(path, planted, marker_path, lambda: DataParallelTrainer.restore(path))


def test_auto_resume_never_unpickles(storage, marker):
    marker_path, planted = marker
    path = crashed_run(storage, "auto", tag="a")
    assert plant(path, planted)
    config = {"iterations": 4, "fail_at": [[3, 1]], "ckpt_every": 2, "obj": Opaque("a")}
    result = DataParallelTrainer(closure_loop(), train_loop_config=config,
                                 run_config=RunConfig(name="auto", storage_path=storage, verbose=0)).fit()
    assert result.status == "FINISHED" and len(run_json(path)["attempts"]) == 2
    assert not marker_path.exists()


def test_a_trainer_class_saved_by_value_is_refused_too(storage, marker):
    marker_path, planted = marker
    assert "FAILED AS PLANNED" in run_script(MAIN_TRAINER, storage).stdout
    path = os.path.join(storage, "main")
    assert plant(path, planted) == [".unbroken/pickled/__trainer_class__.pkl"]
    assert BaseTrainer.can_restore(path)
    with pytest.raises(PickleRefusedError) as info:
        BaseTrainer.restore(path, allow_pickle=False)
    message = str(info.value)
    assert "__main__:MainTrainer" in message and "MainTrainer.restore(...)" in message
    assert not marker_path.exists()


# -- sweeps ---------------------------------------------------------------------------------------
def errored_sweep(storage, tmp_path, name="sweep"):
    """A finished sweep with one ERROR trial, whose trainable and param_space['obj'] are pickled."""
    space = {"x": 2, "iterations": 3, "fail_once": str(tmp_path / f"{name}.failed"), "obj": Opaque("a")}
    grid = Tuner(closure_trainable(), param_space=space,
                 run_config=RunConfig(name=name, storage_path=storage, verbose=0)).fit()
    assert [r.trial_status for r in grid] == ["ERROR"]
    path = os.path.join(storage, name)
    sweep = json.load(open(os.path.join(path, ".unbroken", "sweep.json")))
    assert sweep["pickled_params"] == ["param_space/obj", "trainable"] and sweep["schema_version"] == 2
    return path, space


def test_sweep_readers_and_restore_never_unpickle(storage, tmp_path, marker):
    marker_path, planted = marker
    path, space = errored_sweep(storage, tmp_path)
    assert plant(path, planted) == [".unbroken/pickled/tuner/param_space%2Fobj.pkl",
                                    ".unbroken/pickled/tuner/trainable.pkl",
                                    "trial_00000/.unbroken/pickled/train_loop_config.pkl",
                                    "trial_00000/.unbroken/pickled/train_loop_per_worker.pkl"]
    trial = os.path.join(path, "trial_00000")
    for args in (["ls", storage], ["ls", path], ["show", trial], ["verify", trial]):
        out = cli(*args)
        assert out.returncode == 0, (args, out.stdout, out.stderr)
        assert not marker_path.exists(), f"unbroken {' '.join(args)} unpickled something"
    assert Tuner.can_restore(path) and not Tuner.can_restore(trial)
    assert Result.from_path(trial).status == "ERRORED"
    assert not marker_path.exists()

    with pytest.raises(PickleRefusedError) as info:
        Tuner.restore(path, allow_pickle=False)
    message = str(info.value)
    assert "trainable" in message and "'obj'" in message
    assert f"Tuner.restore({path!r}, allow_pickle=False, trainable=..., param_space=...)" in message
    with pytest.raises(PickleRefusedError) as info:
        Tuner.restore(path, closure_trainable(), allow_pickle=False)
    assert f"Tuner.restore({path!r}, trainable, allow_pickle=False, param_space=...)" in str(info.value)
    assert not marker_path.exists()

    # Re-specifying what was pickled: the sweep and its trial continue; nothing is unpickled.
    tuner = Tuner.restore(path, closure_trainable(), param_space={**space, "obj": Opaque("b")},
                          resume_errored=True, allow_pickle=False)
    grid = tuner.fit()
    assert [r.trial_status for r in grid] == ["TERMINATED"] and grid[0].metrics["it"] == 3
    assert not marker_path.exists()

    # Control: restoring without re-specifying reads the planted files.
    assert_reads_planted(path, planted, marker_path, lambda: Tuner.restore(path))


def test_a_changed_param_space_shape_is_refused_without_unpickling(storage, tmp_path, marker):
    marker_path, planted = marker
    path, space = errored_sweep(storage, tmp_path, "shape")
    plant(path, planted)
    with pytest.raises(ValueError, match="keys or search domains") as info:
        Tuner.restore(path, closure_trainable(), param_space={**space, "extra": 1}, allow_pickle=False)
    assert not isinstance(info.value, PickleRefusedError)
    assert not marker_path.exists()


# -- runs and sweeps written by schema 1 (one pickled container) -------------------------------------
def _to_container(meta, directory, container):
    blobs = {}
    for name in os.listdir(os.path.join(meta, directory)):
        with open(os.path.join(meta, directory, name), "rb") as f:
            blobs[urllib.parse.unquote(name[: -len(".pkl")])] = f.read()
    open(os.path.join(meta, container), "wb").write(pickle.dumps(blobs))


def _schema_1(meta, names):
    for name in names:
        data = json.load(open(os.path.join(meta, name)))
        data["schema_version"], data["package_version"] = 1, "0.1.0"
        data.get("params", {}).pop("param_space_shape", None)
        json.dump(data, open(os.path.join(meta, name), "w"))


def test_schema_1_run_restores_from_its_container(storage, marker):
    marker_path, planted = marker
    path = crashed_run(storage, "old")
    meta = os.path.join(path, ".unbroken")
    _to_container(meta, "pickled", "trainer.pkl")  # what unbroken 0.1.0 wrote
    shutil.rmtree(os.path.join(meta, "pickled"))
    _schema_1(meta, ["run.json", "run.prev.json"])
    container = open(os.path.join(meta, "trainer.pkl"), "rb").read()

    open(os.path.join(meta, "trainer.pkl"), "wb").write(planted)
    with pytest.raises(PickleRefusedError, match="train_loop_config=..., train_loop_per_worker=..."):
        DataParallelTrainer.restore(path, allow_pickle=False)
    DataParallelTrainer.restore(path, allow_pickle=False, train_loop_per_worker=closure_loop(),
                                train_loop_config=new_config())
    assert not marker_path.exists(), "the container was unpickled although nothing needed it"

    open(os.path.join(meta, "trainer.pkl"), "wb").write(container)
    trainer = DataParallelTrainer.restore(path)
    assert trainer.train_loop_config["obj"].tag == "a"
    result = trainer.fit()
    assert list(result.metrics_dataframe["training_iteration"]) == [1, 2, 3, 4]
    assert run_json(path)["schema_version"] == 2
    assert sorted(os.listdir(os.path.join(meta, "pickled"))) == ["train_loop_config.pkl",
                                                                 "train_loop_per_worker.pkl"]


def test_schema_1_sweep_restores_from_its_container(storage, tmp_path, marker):
    marker_path, planted = marker
    path, space = errored_sweep(storage, tmp_path, "old-sweep")
    meta = os.path.join(path, ".unbroken")
    _to_container(meta, "pickled/tuner", "tuner.pkl")
    shutil.rmtree(os.path.join(meta, "pickled"))
    _schema_1(meta, ["sweep.json", "sweep.prev.json"])
    container = open(os.path.join(meta, "tuner.pkl"), "rb").read()

    open(os.path.join(meta, "tuner.pkl"), "wb").write(planted)
    with pytest.raises(PickleRefusedError, match="older unbroken"):
        Tuner.restore(path, closure_trainable(), param_space=space, allow_pickle=False)
    assert not marker_path.exists()

    open(os.path.join(meta, "tuner.pkl"), "wb").write(container)
    grid = Tuner.restore(path, resume_errored=True).fit()
    assert [r.trial_status for r in grid] == ["TERMINATED"]
    sweep = json.load(open(os.path.join(meta, "sweep.json")))
    assert sweep["schema_version"] == 2
    assert sorted(os.listdir(os.path.join(meta, "pickled", "tuner"))) == ["param_space%2Fobj.pkl",
                                                                         "trainable.pkl"]


# -- a run in a shared bucket -----------------------------------------------------------------------
S3_RUN = """
import sys
from unbroken.train import DataParallelTrainer, RunConfig, TrainingFailedError
def loop(config):
    from toy_loops import toy_loop
    toy_loop(config)
try:
    DataParallelTrainer(loop, train_loop_config={"iterations": 4, "fail_at": [[3, 1]], "ckpt_every": 2},
                        run_config=RunConfig(name="shared", storage_path=sys.argv[1], verbose=0)).fit()
except TrainingFailedError:
    print("FAILED AS PLANNED")
"""

S3_RESTORE = """
import sys
from unbroken.errors import PickleRefusedError
from unbroken.train import DataParallelTrainer, Result
url = sys.argv[1]
assert DataParallelTrainer.can_restore(url)
print("STATUS", Result.from_path(url).status)
try:
    DataParallelTrainer.restore(url, allow_pickle=False)
except PickleRefusedError as e:
    print("REFUSED", e)
def loop(config):
    from toy_loops import toy_loop
    toy_loop(config)
result = DataParallelTrainer.restore(url, allow_pickle=False, train_loop_per_worker=loop).fit()
print("DONE", result.metrics["training_iteration"])
"""


@pytest.mark.slow  # the local readers' tests above are the default run's sample
def test_a_run_in_a_shared_bucket_is_read_without_unpickling(s3_endpoint, marker):
    import boto3

    marker_path, planted = marker
    bucket, prefix = "bucket", f"trust-{os.getpid()}-{marker_path.parent.name}"[:60]
    storage = f"s3://{bucket}/{prefix}"
    url = f"{storage}/shared"
    assert "FAILED AS PLANNED" in run_script(S3_RUN, storage, **s3_env(s3_endpoint)).stdout
    client = boto3.client("s3", endpoint_url=s3_endpoint, **S3_CREDENTIALS)
    meta = f"{prefix}/shared/.unbroken/"
    listing = client.list_objects_v2(Bucket=bucket, Prefix=meta)["Contents"]
    stored = sorted(o["Key"][len(meta):] for o in listing)
    assert stored == ["pickled/train_loop_per_worker.pkl", "run.json", "run.prev.json"]
    for rel in ("pickled/train_loop_per_worker.pkl", "trainer.pkl", "pickled/__trainer_class__.pkl"):
        client.put_object(Bucket=bucket, Key=meta + rel, Body=planted)  # someone else wrote the bucket

    for args in (["ls", storage], ["show", url], ["verify", url]):
        out = subprocess.run([sys.executable, "-m", "unbroken", *args], env=driver_env(**s3_env(s3_endpoint)),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (args, out.stdout, out.stderr)
    out = run_script(S3_RESTORE, url, **s3_env(s3_endpoint)).stdout
    assert "STATUS ERRORED" in out and "DONE 4" in out, out
    assert "REFUSED" in out and "'train_loop_per_worker'" in out and "train_loop_per_worker=...)" in out, out
    assert not marker_path.exists()
