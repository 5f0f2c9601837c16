"""WandbLoggerCallback in W&B's offline mode (no network): one W&B run, by the unbroken run's
id, across a retry and an auto-resume in a new process; each step logged once, in order, with
the values of the run's timeline; the goodput in the run's summary."""

import glob
import json
import os
import struct

import pytest

from conftest import run_script
from unbroken.errors import UnsupportedOptionError
from unbroken.train import Result, WandbLoggerCallback

wandb_pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")

DRIVER = """
import sys
from toy_loops import toy_loop
from unbroken.train import DataParallelTrainer, FailureConfig, RunConfig, TrainingFailedError
from unbroken.train import WandbLoggerCallback
callback = WandbLoggerCallback(project="toys", log_config=True)
failures = FailureConfig(max_failures=int(sys.argv[2]))
try:
    DataParallelTrainer(toy_loop, train_loop_config={"iterations": 8, "fail_at": [[5, 1], [7, 2]]},
                        run_config=RunConfig(name="wb", storage_path=sys.argv[1], verbose=0,
                                             callbacks=[callback], failure_config=failures)).fit()
    print("FINISHED")
except TrainingFailedError:
    print("FAILED")
"""


def records(path: str):
    """The records of a W&B run file (`run-<id>.wandb`): LevelDB's log format, 32 KiB blocks
    of chunks with a 7-byte header, after a 7-byte file header (':W&B', magic, version)."""
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_pb.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def test_one_wandb_run_across_a_retry_and_a_resume_each_step_once(storage):
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    assert "FAILED" in run_script(DRIVER, storage, "0", **env).stdout  # attempt 1 fails at 5
    # The same script again auto-resumes: attempt 2 fails at 7 and is retried from checkpoint 6.
    assert "FINISHED" in run_script(DRIVER, storage, "1", **env).stdout
    path = os.path.join(storage, "wb")
    run_id = json.load(open(os.path.join(path, ".unbroken", "run.json")))["run_id"]
    files = sorted(glob.glob(os.path.join(path, "wandb", "offline-run-*", "run-*.wandb")))
    assert len(files) == 2 and all(f.endswith(f"run-{run_id}.wandb") for f in files), files
    logged, summary, config = [], {}, {}
    for f in files:
        for record in records(f):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json)
                         for i in record.history.item}
                logged.append((record.history.step.num, items["loss"]))
            elif kind == "summary":
                summary.update({"/".join(i.nested_key) or i.key: json.loads(i.value_json)
                                for i in record.summary.update})
            elif kind == "run":  # the run's start, with its config
                config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
    timeline = [(r["training_iteration"], r["loss"]) for r in Result.from_path(path).rows]
    assert [step for step, _ in logged] == list(range(1, 9)), "each step once, in order"
    assert [v for _, v in logged] == pytest.approx([v for _, v in timeline])
    assert summary["goodput"] == pytest.approx(Result.from_path(path).time_spent().goodput, rel=1e-6)
    assert config["iterations"] == 8, "log_config: the train_loop_config"


def test_what_unbroken_does_not_do_is_refused_with_a_hint():
    with pytest.raises(UnsupportedOptionError, match="checkpoints stay in the run directory"):
        WandbLoggerCallback(upload_checkpoints=True)
    with pytest.raises(UnsupportedOptionError, match="resumed by its run_id"):
        WandbLoggerCallback(id="mine")
