"""Damaged storage: a torn or corrupted newest checkpoint, a damaged run.json."""

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest

from conftest import driver_env
from loops import simple_loop
from unbroken.errors import TornCheckpointError
from unbroken.store import commit
from unbroken.store.storage import Storage
from unbroken.train import DataParallelTrainer, RunConfig, ScalingConfig, TrainingFailedError

ITERATIONS = 6


@pytest.fixture(scope="module")
def errored_run(tmp_path_factory):
    storage = str(tmp_path_factory.mktemp("stored"))
    with pytest.raises(TrainingFailedError):
        DataParallelTrainer(simple_loop, train_loop_config={"iterations": ITERATIONS, "fail_at": 4},
                            scaling_config=ScalingConfig(num_workers=2),
                            run_config=RunConfig(name="errored", storage_path=storage)).fit()
    return os.path.join(storage, "errored")


@pytest.fixture
def run(errored_run, tmp_path):
    path = str(tmp_path / "errored")
    shutil.copytree(errored_run, path)
    return path


def checkpoints(run: str) -> list[str]:
    return sorted(n for n in os.listdir(run) if commit.iteration_of(n) is not None)


def flip(path: str) -> None:
    with open(path, "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0x80]))


DAMAGE = {
    "bit-flip": lambda d: flip(os.path.join(d, "it.txt")),
    "truncated": lambda d: open(os.path.join(d, "it.txt"), "r+b").truncate(0),
    "file-deleted": lambda d: os.remove(os.path.join(d, "it.txt")),
    "marker-deleted": lambda d: os.remove(os.path.join(d, commit.MARKER)),
}
REPORTED = {"bit-flip": "does not match its hash", "truncated": "has 0 bytes",
            "file-deleted": "is missing", "marker-deleted": "no commit marker"}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(run, damage, caplog):
    *_, previous, newest = checkpoints(run)
    DAMAGE[damage](os.path.join(run, newest))
    with pytest.raises(TornCheckpointError, match=REPORTED[damage]):
        commit.verify(Storage.from_url(run), newest, full=True)
    # `unbroken verify` reports it, and exits 1.
    verify = subprocess.run([sys.executable, "-m", "unbroken", "verify", run, "--json"],
                            capture_output=True, text=True, env=driver_env())
    assert verify.returncode == 1, verify.stderr
    states = {c["name"]: c for c in json.loads(verify.stdout)["checkpoints"]}
    assert states[newest]["state"] in ("torn", "corrupted")
    assert any(REPORTED[damage] in p for p in states[newest]["problems"]), states[newest]
    assert states[previous]["state"] == "committed"
    original = sorted(os.listdir(os.path.join(run, newest)))

    with caplog.at_level(logging.WARNING, logger="unbroken"):
        result = DataParallelTrainer.restore(run).fit()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(newest in w and REPORTED[damage] in w and "previous one" in w for w in warnings), warnings

    manifest = json.load(open(os.path.join(run, ".unbroken", "run.json")))
    assert manifest["attempts"][-1]["resumed_from"] == previous
    assert sorted(os.listdir(os.path.join(run, f"{newest}.corrupt-0"))) == original, "set aside, not deleted"
    assert list(result.metrics_dataframe["training_iteration"]) == list(range(1, ITERATIONS + 1))


@pytest.mark.parametrize("damage", ["garbage", "truncated", "deleted"])
def test_damaged_run_json_falls_back_to_the_previous_generation(run, damage, caplog):
    path = os.path.join(run, ".unbroken", "run.json")
    generation = json.load(open(path))["generation"]
    if damage == "garbage":
        open(path, "wb").write(b"\x89not json")
    elif damage == "truncated":
        open(path, "r+b").truncate(os.path.getsize(path) // 2)
    else:
        os.remove(path)
    assert DataParallelTrainer.can_restore(run)
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        result = DataParallelTrainer.restore(run).fit()
    assert any("using the previous generation" in r.getMessage() and "run.prev.json" in r.getMessage()
               for r in caplog.records)
    assert list(result.metrics_dataframe["training_iteration"]) == list(range(1, ITERATIONS + 1))
    assert json.load(open(path))["generation"] > generation
