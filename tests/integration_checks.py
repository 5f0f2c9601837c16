"""What the Lightning and Transformers integration tests share (no framework imported here):
a driver script, a fault knob for the loops, and the checks that a resumed run repeated the
uninterrupted one."""

from __future__ import annotations

import json
import os

import torch

from conftest import read_until, run_json, start_script
from unbroken import train

# A training script: TorchTrainer(<loop>) on 2 workers, named by argv; prints "DONE <iteration>
# <attempt>". Running it again with the same arguments resumes the run.
DRIVER = """
import json, sys
from unbroken.train import RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer
from {module} import {loop}
result = TorchTrainer({loop}, train_loop_config=json.loads(sys.argv[3]),
                      scaling_config=ScalingConfig(num_workers=2),
                      run_config=RunConfig(name=sys.argv[2], storage_path=sys.argv[1])).fit()
print("DONE", result.metrics["training_iteration"], result.metrics["attempt"])
"""

RESTORE = """
import sys
from unbroken.train.torch import TorchTrainer
result = TorchTrainer.restore(sys.argv[1]).fit()
print("DONE", result.metrics["training_iteration"], result.metrics["attempt"])
"""


def block_at(config: dict, point: int) -> None:
    """Block forever at `config["block_at"] = [point, fifo]` in attempt 1 (the test kills the
    driver while it waits there)."""
    block = config.get("block_at")
    if block and block[0] == point and train.get_context().get_attempt() == 1:
        with open(block[1]) as f:
            f.read()


def kill_driver_at(module: str, loop: str, storage: str, name: str, config: dict, line: str) -> None:
    """Start DRIVER for `module.loop`, wait for the worker's `line` (it then blocks, see
    block_at) and SIGKILL the driver; its workers die with it."""
    os.mkfifo(config["block_at"][1])
    driver = start_script(DRIVER.format(module=module, loop=loop), storage, name, json.dumps(config))
    try:
        read_until(driver, line)
    finally:
        driver.kill()
        driver.wait()
        driver.stdout.close()
        driver.stderr.close()


def rows(result, columns: list[str]) -> list[tuple]:
    df = result.metrics_dataframe
    return [tuple(row) for row in df[columns].itertuples(index=False)]


def check_resumed_like(result, reference, columns: list[str], steps_per_iteration: int) -> int:
    """`result` is a run that was interrupted once and resumed: each iteration and step is in its
    timeline once, the last attempt started training at the global step of the checkpoint it
    resumed from (not at 0), and every metric in `columns` equals the uninterrupted `reference`'s,
    bit for bit. Returns the iteration it resumed from."""
    df = result.metrics_dataframe
    assert list(df["training_iteration"]) == list(range(1, len(reference.metrics_dataframe) + 1))
    assert list(df["step"]) == list(reference.metrics_dataframe["step"]), "each step reported once"
    attempts = run_json(result.path)["attempts"]
    assert len(attempts) == 2 and attempts[0]["status"] in ("ERRORED", "ABORTED", "INTERRUPTED", "PREEMPTED")
    resumed = attempts[1]["resumed_iteration"]
    assert resumed >= 1 and attempts[1]["resumed_from"] == f"checkpoint_{resumed:06d}"
    assert list(df["attempt"]) == [1] * resumed + [2] * (len(df) - resumed)
    assert set(df["start_step"][resumed:]) == {resumed * steps_per_iteration}, "resumed at the saved step"
    assert rows(result, columns) == rows(reference, columns)
    return resumed


def assert_equal_tensors(a: dict, b: dict) -> None:
    """Two state dicts (nested dicts/lists of tensors and values) are equal, bit for bit."""
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]), key
        elif isinstance(value, dict):
            assert_equal_tensors(value, b[key])
        elif isinstance(value, list):
            assert_equal_tensors(dict(enumerate(value)), dict(enumerate(b[key])))
        else:
            assert value == b[key], key
