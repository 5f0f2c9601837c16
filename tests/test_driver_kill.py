"""The driver process itself is SIGKILLed mid-run; a new process restores and finishes."""

import json
import os
import select
import signal
import subprocess
import sys

import torch

from conftest import driver_env, read_until, run_script, start_script
from loops import final_weights
from unbroken.train import Result
from unbroken.train.torch import TorchTrainer

DRIVER = """
import sys, torch
from loops import linear_loop
from unbroken.train import RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer
storage, name, iterations = sys.argv[1], sys.argv[2], int(sys.argv[3])
result = TorchTrainer(linear_loop, train_loop_config={"iterations": iterations, "ckpt_every": 3,
                                                      "echo": True, "pid_dir": sys.argv[4]},
                      scaling_config=ScalingConfig(num_workers=2),
                      run_config=RunConfig(name=name, storage_path=storage)).fit()
print("DONE", result.metrics["training_iteration"], result.metrics["attempt"])
"""

RESTORE = """
import sys
from unbroken.train.torch import TorchTrainer
path = sys.argv[1]
assert TorchTrainer.can_restore(path)
result = TorchTrainer.restore(path).fit()
print("DONE", result.metrics["training_iteration"], result.metrics["attempt"])
"""


def wait_exited(pid: int, timeout: float) -> bool:
    """True once process `pid` has exited (pidfd: woken by the exit itself)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def worker_pids(driver_pid: int) -> list[int]:
    children = open(f"/proc/{driver_pid}/task/{driver_pid}/children").read().split()
    return [int(p) for p in children]


def test_driver_sigkill_then_restore_in_a_new_process(storage, tmp_path):
    name, iterations = "killed-driver", 12
    driver = start_script(DRIVER, storage, name, str(iterations), str(tmp_path))
    # Rank 0 sends report 8 only after the driver's reply to report 7: by then row 7 is
    # recorded and checkpoint 6 committed (reports are pipelined one deep).
    read_until(driver, "REPORTED 8")
    workers = worker_pids(driver.pid)
    assert len(workers) == 2
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    # Workers die with their driver (no orphan keeps writing to the run).
    assert all(wait_exited(pid, 10) for pid in workers)

    path = os.path.join(storage, name)
    assert TorchTrainer.can_restore(path)
    before = Result.from_path(path)
    assert before.checkpoint.path.endswith("checkpoint_000006")
    assert before.metrics["training_iteration"] >= 7
    resumed_from = "000006"

    out = run_script(RESTORE, path)
    assert f"DONE {iterations} 2" in out.stdout
    assert TorchTrainer.can_restore(path)

    result = Result.from_path(path)
    df = result.metrics_dataframe
    assert list(df["training_iteration"]) == list(range(1, iterations + 1)), "each iteration once"
    assert df["time_total_s"].is_monotonic_increasing
    rows = [json.loads(line) for line in open(os.path.join(path, "result.json"))]
    abandoned = [r for r in rows if r["attempt"] == 1 and r["training_iteration"] > int(resumed_from)]
    assert abandoned, "rows after the resumed checkpoint stay on disk, tagged with their attempt"
    manifest = json.load(open(os.path.join(path, ".unbroken", "run.json")))
    assert manifest["status"] == "FINISHED" and len(manifest["attempts"]) == 2
    assert manifest["attempts"][1]["resumed_from"] == f"checkpoint_{resumed_from}"
    assert manifest["attempts"][0]["status"] == "ABORTED", "the killed driver's attempt is closed"
    assert not [n for n in os.listdir(path) if ".tmp-" in n], "uncommitted leftovers cleaned"

    reference = run_script(DRIVER, storage, "reference", str(iterations), str(tmp_path))
    assert f"DONE {iterations} 1" in reference.stdout
    expected = final_weights(Result.from_path(os.path.join(storage, "reference")))
    for key, value in final_weights(result).items():
        assert torch.equal(value, expected[key])



def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in worker_pids(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def test_workers_from_a_forkserver_die_with_a_killed_driver(storage, tmp_path):
    # Forkserver workers re-import the main module, so the script needs a main guard.
    script = tmp_path / "driver.py"
    script.write_text("if __name__ == '__main__':\n" +
                      "".join(f"    {line}\n" for line in DRIVER.strip().splitlines()))
    proc = subprocess.Popen([sys.executable, "-u", str(script), storage, "fs-killed", "1000", str(tmp_path)],
                            env=driver_env(UNBROKEN_START_METHOD="forkserver"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    read_until(proc, "REPORTED 2")
    family = descendants(proc.pid)
    assert len(family) >= 3, family  # the forkserver and two workers
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert all(wait_exited(pid, 10) for pid in family), "no worker outlives its driver"
