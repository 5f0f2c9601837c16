"""A run whose storage fills up fails with a clear error, and resumes as soon as there is
room for one checkpoint: restores remove the leftovers that hold the space before they
write anything. On a real (small tmpfs) filesystem; skipped where mounting is not allowed."""

import errno
import json
import os
import subprocess

import pytest

from loops import big_checkpoint_loop
from unbroken.errors import StorageFullError
from unbroken.train import (
    CheckpointConfig,
    DataParallelTrainer,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
)

KIB = 1024


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield str(mount)
    subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(path: str) -> None:
    """Write to `path` until the filesystem is full, as a worker killed mid-upload leaves it."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            while True:
                f.write(b"x" * 4096)
                f.flush()
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    assert os.statvfs(path.rsplit("/", 2)[0]).f_bavail == 0


def test_a_full_disk_fails_clearly_and_the_run_resumes_once_a_checkpoint_fits(small_disk):
    config = {"iterations": 8, "ckpt_bytes": 150 * KIB}
    with pytest.raises(TrainingFailedError) as info:
        DataParallelTrainer(big_checkpoint_loop, train_loop_config=config,
                            scaling_config=ScalingConfig(num_workers=2),
                            run_config=RunConfig(name="full", storage_path=small_disk)).fit()
    cause = info.value.__cause__
    assert isinstance(cause, StorageFullError), repr(cause)
    message = str(cause)
    assert "is full" in message and "150.0 KiB needed" in message and "free" in message, message
    assert "CheckpointConfig(num_to_keep=N)" in message and "Hint" in message, message
    path = os.path.join(small_disk, "full")
    manifest = json.load(open(os.path.join(path, ".unbroken", "run.json")))
    assert manifest["status"] == "ERRORED", "the failure itself was recorded"
    latest = manifest["latest_checkpoint"]
    assert latest is not None

    # A worker killed mid-upload leaves a torn checkpoint holding the last free byte.
    staging = os.path.join(path, f"checkpoint_{int(latest[-6:]) + 1:06d}.tmp-1")
    fill(os.path.join(staging, "torn.bin"))
    result = DataParallelTrainer.restore(
        path, run_config=RunConfig(checkpoint_config=CheckpointConfig(num_to_keep=1))).fit()
    assert list(result.metrics_dataframe["training_iteration"]) == list(range(1, 9))
    assert result.checkpoint.path.endswith("checkpoint_000008")
    assert not os.path.exists(staging)
    assert sorted(e for e in os.listdir(path) if e.startswith("checkpoint_")) == ["checkpoint_000008"]


def resize(mount: str, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", mount], check=True, capture_output=True)


def test_a_disk_that_fills_up_at_any_moment_fails_cleanly_and_the_run_resumes(small_disk):
    """Whatever is being written when the space runs out (rows, manifest, lease, checkpoint
    files), fit() fails with StorageFullError, and a restore once there is room finishes the
    run with each iteration once."""
    config = {"iterations": 4, "ckpt_bytes": 6 * KIB}
    outcomes = set()
    for pages in range(0, 41):
        storage = os.path.join(small_disk, f"p{pages}")
        os.makedirs(storage)
        st = os.statvfs(small_disk)
        resize(small_disk, max((st.f_blocks - st.f_bfree) * st.f_frsize + pages * 4096, 4096))
        try:
            DataParallelTrainer(big_checkpoint_loop, train_loop_config=config,
                                scaling_config=ScalingConfig(num_workers=2),
                                run_config=RunConfig(name="run", storage_path=storage)).fit()
            outcomes.add("finished")
        except (StorageFullError, TrainingFailedError) as e:
            cause = e if isinstance(e, StorageFullError) else e.__cause__
            assert isinstance(cause, StorageFullError), f"{pages} pages free: {cause!r}"
            outcomes.add("full")
        finally:
            resize(small_disk, 64 << 20)
        path = os.path.join(storage, "run")
        if DataParallelTrainer.can_restore(path):
            result = DataParallelTrainer.restore(path).fit()
            assert list(result.metrics_dataframe["training_iteration"]) == [1, 2, 3, 4], pages
            assert not [e for e in os.listdir(path) if ".tmp-" in e or ".del-" in e]
    assert "full" in outcomes, "the disk never filled up: the test proves nothing"
