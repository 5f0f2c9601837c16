"""Training loops and validation functions for tests/test_validation.py (importable by the
worker and validation processes, and by driver scripts)."""

import json
import os
import sys
import tempfile

from unbroken import train
from unbroken.train import ValidationTaskConfig


def save_value(value: float) -> train.Checkpoint:
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "value.json"), "w") as f:
        json.dump({"value": value}, f)
    return train.Checkpoint.from_directory(d)


def validation_loop(config):
    """Reports 1..iterations; a checkpoint each time on rank 0, with the validation each
    iteration's `asks` says: "yes" (the trainer's defaults), "kwargs" (fn_kwargs of its own),
    or nothing. Returns what get_all_reported_checkpoints says at the end."""
    rank = train.get_context().get_world_rank()
    start = train.get_checkpoint()
    first = 1
    if start is not None:
        with start.as_directory() as d:
            first = int(json.load(open(os.path.join(d, "value.json")))["value"]) + 1
    for i in range(first, config["iterations"] + 1):
        ask = config.get("asks", {}).get(str(i))
        validation = {"yes": True, "kwargs": ValidationTaskConfig(fn_kwargs={"scale": 100})}.get(ask, False)
        checkpoint = save_value(i) if rank == 0 else None
        train.report({"loss": 1.0 / i, "i": i}, checkpoint=checkpoint,
                     validation=validation if rank == 0 else False)
    mode = train.CheckpointConsistencyMode[config.get("mode", "VALIDATED")]
    return [(r.checkpoint.path.rsplit("/", 1)[1], r.status.value, r.metrics.get("val"), r.metrics["loss"])
            for r in train.get_all_reported_checkpoints(consistency_mode=mode)]


def validate(checkpoint, scale=1, fail_at=None, block_at=None):
    """The checkpoint's value times `scale` as "val", and a "loss" of its own (which replaces
    the reported one). Raises at value `fail_at`; at value `block_at`, with UNBROKEN_TEST_BLOCK
    set, blocks on that FIFO until the process is killed."""
    with checkpoint.as_directory() as d:
        value = json.load(open(os.path.join(d, "value.json")))["value"]
    name = checkpoint.path.rsplit("/", 1)[1]
    print("VALIDATING", name, flush=True)
    sys.stdout.flush()
    if value == fail_at:
        raise ValueError(f"validation refuses value {value}")
    if value == block_at and os.environ.get("UNBROKEN_TEST_BLOCK"):
        open(os.environ["UNBROKEN_TEST_BLOCK"]).read()  # blocks: nobody opens the FIFO to write
    return {"val": value * scale, "loss": -value}


def validate_where(checkpoint, marker_env=""):
    """`validate`, and whether it ran where the environment variable `marker_env` is set."""
    return {**validate(checkpoint), "ran_there": marker_env in os.environ}
