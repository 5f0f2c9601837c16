"""Training functions written against Ray Train V2's API (importable, so saved by reference)."""

from __future__ import annotations

import json
import os
import tempfile

from unbroken import train
from unbroken.train import Checkpoint, CheckpointUploadMode, UserCallback


def shard_loop(config: dict) -> dict:
    """Each rank writes its own shard file; every other report is metric-only; checkpoints
    get custom names and go through ASYNC (which deletes the local directory). Returns what
    the run reported so far, as get_all_reported_checkpoints sees it at the end."""
    ctx = train.get_context()
    rank = ctx.get_world_rank()
    storage = ctx.get_storage()
    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            start = json.load(open(os.path.join(d, f"shard_{rank}.json")))["epoch"]
    kept_local = []
    for epoch in range(start + 1, config["epochs"] + 1):
        train.report({"epoch": epoch, "phase": "train", "rank": rank})
        d = tempfile.mkdtemp()
        with open(os.path.join(d, f"shard_{rank}.json"), "w") as f:
            json.dump({"epoch": epoch, "rank": rank}, f)
        name = config.get("name", "epoch_{epoch}").format(epoch=epoch, rank=rank)
        train.report({"epoch": epoch, "phase": "ckpt", "score": (epoch * 7) % 5},
                     checkpoint=Checkpoint.from_directory(d), checkpoint_dir_name=name,
                     checkpoint_upload_mode=CheckpointUploadMode[config.get("mode", "ASYNC")])
        kept_local.append(os.path.exists(d))
    reported = train.get_all_reported_checkpoints()
    return {"reported": [(os.path.basename(r.checkpoint.path), r.metrics["training_iteration"])
                         for r in reported],
            "statuses": sorted({r.status.value for r in reported}),
            "kept_local": kept_local,
            "storage": [storage.storage_path, storage.experiment_dir_name,
                        os.path.isdir(storage.experiment_fs_path)]}


def option_loop(config: dict) -> None:
    """Reports once, with a checkpoint, passing the keyword arguments in config["report"]
    (an upload mode by its member name)."""
    kwargs = dict(config["report"])
    if "checkpoint_upload_mode" in kwargs:
        kwargs["checkpoint_upload_mode"] = CheckpointUploadMode[kwargs["checkpoint_upload_mode"]]
    d = tempfile.mkdtemp()
    open(os.path.join(d, "w.bin"), "wb").write(b"w")
    train.report({"x": 1}, checkpoint=Checkpoint.from_directory(d), **kwargs)


def epochs_loop(config: dict) -> None:
    """A V2-style loop that resumes from its checkpoint's epoch and trains to config["epochs"]."""
    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            start = int(open(os.path.join(d, "epoch")).read())
    for epoch in range(start + 1, config["epochs"] + 1):
        d = tempfile.mkdtemp()
        open(os.path.join(d, "epoch"), "w").write(str(epoch))
        train.report({"epoch": epoch}, checkpoint=Checkpoint.from_directory(d),
                     checkpoint_dir_name=f"epoch_{epoch}")


class Recorder(UserCallback):
    """Appends one JSON line per after_report / after_exception call to `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def _write(self, entry: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def after_report(self, run_context, metrics, checkpoint) -> None:
        self._write({"attempt": run_context.attempt, "metrics": metrics,
                     "checkpoint": os.path.basename(checkpoint.path) if checkpoint else None})

    def after_exception(self, run_context, worker_exceptions) -> None:
        self._write({"attempt": run_context.attempt,
                     "exception": {str(r): type(e).__name__ for r, e in worker_exceptions.items()}})


def torch_helpers_loop(config: dict) -> list:
    """Ray Train's torch helpers: enable_reproducibility, then two seeded draws; get_devices."""
    import torch

    from unbroken.train.torch import enable_reproducibility, get_devices

    enable_reproducibility(seed=config["seed"])
    draw = torch.rand(2).tolist()
    train.report({"deterministic": torch.are_deterministic_algorithms_enabled()})
    return [draw, [str(d) for d in get_devices()]]


def env_loop(config: dict) -> str:
    """Returns the value of the environment variable config["name"] in rank 0."""
    train.report({"x": 1})
    return os.environ.get(config["name"], "")


def follow_loop(config: dict) -> dict:
    """Reports `iterations` times; rank 0 attaches a checkpoint to every other report (ASYNC
    with `async`). After each report every rank notes what train.get_checkpoint() returns;
    returns rank 0's notes, and writes rank 1's to `<dir>/rank1.json`."""
    rank = train.get_context().get_world_rank()
    mode = CheckpointUploadMode.ASYNC if config.get("async") else CheckpointUploadMode.SYNC
    start = train.get_checkpoint()
    seen = [os.path.basename(start.path) if start else None]
    for it in range(1, config["iterations"] + 1):
        with tempfile.TemporaryDirectory() as d:
            if rank == 0 and it % 2 == 0:
                open(os.path.join(d, "it.txt"), "w").write(str(it))
                train.report({"it": it}, checkpoint=Checkpoint.from_directory(d),
                             checkpoint_upload_mode=mode)
            else:
                train.report({"it": it})
        if config.get("async"):
            train.get_all_reported_checkpoints()  # waits for this rank's latest save to commit
        latest = train.get_checkpoint()
        seen.append(os.path.basename(latest.path) if latest else None)
    if rank == 1:
        with open(os.path.join(config["dir"], "rank1.json"), "w") as f:
            json.dump(seen, f)
    return {"seen": seen}
