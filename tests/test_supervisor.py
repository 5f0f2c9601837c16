"""`unbroken run -- CMD`: the supervisor that starts a training script again when its driver
dies. Real scripts, real kills (the fault points of `unbroken.core.faults`), real signals."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import torch

from conftest import attempts, driver_env, read_until, run_json, run_script, statuses, sweep_json
from loops import final_weights, linear_loop
from unbroken.train import Result, RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer

RESTART = re.compile(r"^unbroken run: .*; restart (\d+) of (\d+) in .*, resuming (run|sweep) (\S+) ")

# A tiny torch model, one worker on the CPU, a checkpoint at every report.
TORCH_SCRIPT = """
import sys
from loops import linear_loop
from unbroken.train import RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer
if __name__ == "__main__":
    storage, name, iterations = sys.argv[1], sys.argv[2], int(sys.argv[3])
    result = TorchTrainer(linear_loop, train_loop_config={"iterations": iterations, "ckpt_every": 1},
                          scaling_config=ScalingConfig(num_workers=1),
                          run_config=RunConfig(name=name, storage_path=storage, verbose=0)).fit()
    print("DONE", result.metrics["training_iteration"])
"""

# A torch-free loop (cheaper to start): a checkpoint at every report; exits with argv[4], if given,
# after fit() returned.
TOY_SCRIPT = """
import sys
from toy_loops import toy_loop
from unbroken.train import DataParallelTrainer, RunConfig
if __name__ == "__main__":
    storage, name, iterations = sys.argv[1], sys.argv[2], int(sys.argv[3])
    DataParallelTrainer(toy_loop, train_loop_config={"iterations": iterations, "ckpt_every": 1, "echo": True},
                        run_config=RunConfig(name=name, storage_path=storage, verbose=0)).fit()
    sys.exit(int(sys.argv[4]) if len(sys.argv) > 4 else 0)
"""

SWEEP_SCRIPT = """
import sys
from tune_loops import tune_loop
from unbroken import tune
from unbroken.train import RunConfig
if __name__ == "__main__":
    tune.Tuner(tune_loop, param_space={"x": tune.grid_search([1, 2]), "iterations": 3},
               tune_config=tune.TuneConfig(metric="score", mode="max"),
               run_config=RunConfig(name=sys.argv[2], storage_path=sys.argv[1], verbose=0)).fit()
"""


def script(tmp_path, code: str) -> str:
    path = tmp_path / "train.py"
    path.write_text(code)
    return str(path)


def supervisor_args(path: str, *args: str, restarts: int = 2) -> list[str]:
    return [sys.executable, "-m", "unbroken", "run", "--max-restarts", str(restarts), "--backoff-s", "0",
            "--", sys.executable, path, *args]


def supervise(path: str, *args: str, restarts: int = 2, **env) -> subprocess.CompletedProcess:
    """`python -m unbroken run -- python <path> args...` to its end (no backoff, for speed)."""
    return subprocess.run(supervisor_args(path, *args, restarts=restarts), env=driver_env(**env),
                          capture_output=True, text=True, timeout=240)


def restart_lines(stderr: str) -> list[re.Match]:
    return [m for line in stderr.splitlines() if (m := RESTART.match(line))]


def notes(stderr: str) -> list[str]:
    """Every line the supervisor itself printed."""
    return [line for line in stderr.splitlines() if line.startswith("unbroken run:")]


def test_a_killed_driver_is_started_again_and_its_run_finishes_as_if_never_killed(storage, tmp_path):
    name, iterations = "killed", 6
    log = str(tmp_path / "faults")
    out = supervise(script(tmp_path, TORCH_SCRIPT), storage, name, str(iterations),
                    UNBROKEN_FAULT="after_marker:3:kill::once", UNBROKEN_FAULT_LOG=log)
    assert out.returncode == 0, out.stderr
    assert f"DONE {iterations}" in out.stdout
    assert open(log).read().split()[0] == "after_marker", "the first driver was killed by the fault"
    path = os.path.join(storage, name)
    lines = restart_lines(out.stderr)
    assert len(lines) == 1 and len(notes(out.stderr)) == 1, notes(out.stderr)
    assert lines[0].groups() == ("1", "2", "run", path)
    assert "killed by SIGKILL" in lines[0].string

    manifest = run_json(path)
    assert manifest["status"] == "FINISHED"
    assert [a["status"] for a in manifest["attempts"]] == ["ABORTED", "FINISHED"]
    resumed = manifest["attempts"][1]["resumed_iteration"]
    assert resumed >= 2
    rows = [json.loads(line) for line in open(os.path.join(path, "result.json"))]
    kept = [r["training_iteration"] for r in rows
            if r["attempt"] == 2 or r["training_iteration"] <= resumed]
    assert kept == list(range(1, iterations + 1)), "each iteration once"
    result = Result.from_path(path)
    assert list(result.metrics_dataframe["training_iteration"]) == list(range(1, iterations + 1))

    reference = TorchTrainer(linear_loop, train_loop_config={"iterations": iterations, "ckpt_every": 1},
                             scaling_config=ScalingConfig(num_workers=1),
                             run_config=RunConfig(name="reference", storage_path=storage, verbose=0)).fit()
    expected = final_weights(reference)
    for key, value in final_weights(result).items():
        assert torch.equal(value, expected[key])


def test_no_restart_when_the_launch_opened_nothing(storage, tmp_path):
    """The first driver is killed; the script, run again with another config, is refused before
    it opens the run (IdentityMismatchError): starting it again cannot help."""
    path = script(tmp_path, TOY_SCRIPT)
    first = subprocess.run([sys.executable, path, storage, "changed", "6"], env=driver_env(
        UNBROKEN_FAULT="after_marker:2:kill"), capture_output=True, text=True, timeout=240)
    assert first.returncode == -signal.SIGKILL, first.stderr
    run = os.path.join(storage, "changed")
    before = open(os.path.join(run, ".unbroken", "run.json")).read()

    out = supervise(path, storage, "changed", "8")
    assert out.returncode == 1, out.stderr
    assert "IdentityMismatchError" in out.stderr
    assert restart_lines(out.stderr) == []
    assert len(notes(out.stderr)) == 1 and "opened no run or sweep" in notes(out.stderr)[0]
    assert open(os.path.join(run, ".unbroken", "run.json")).read() == before, "the run is untouched"


def test_no_restart_when_the_run_finished_and_the_script_then_fails(storage, tmp_path):
    out = supervise(script(tmp_path, TOY_SCRIPT), storage, "done", "3", "5")
    assert out.returncode == 5, out.stderr
    assert restart_lines(out.stderr) == []
    assert notes(out.stderr) == [f"unbroken run: the command exited with code 5; not restarting: "
                                 f"run {os.path.join(storage, 'done')} (FINISHED)"]
    assert attempts(os.path.join(storage, "done")) == ["FINISHED"]


def test_stops_at_its_limit_and_exits_with_the_signal_code(storage, tmp_path):
    """Every launch is killed in its second commit: two restarts, then exit 128 + SIGKILL."""
    out = supervise(script(tmp_path, TOY_SCRIPT), storage, "doomed", "10", restarts=2,
                    UNBROKEN_FAULT="after_marker:2:kill")
    assert out.returncode == 128 + signal.SIGKILL, out.stderr
    assert [m.group(1, 2) for m in restart_lines(out.stderr)] == [("1", "2"), ("2", "2")]
    assert "not restarting: 2 restarts reached" in notes(out.stderr)[-1]
    assert len(notes(out.stderr)) == 3
    run = os.path.join(storage, "doomed")
    resumed = [a["resumed_from"] for a in run_json(run)["attempts"]]
    assert resumed == [None, "checkpoint_000001", "checkpoint_000002"], "each launch resumed the run"


def test_sigterm_to_the_supervisor_reaches_the_driver_once_and_nothing_restarts(storage, tmp_path):
    err = tmp_path / "stderr"
    with open(err, "w") as stderr:
        proc = subprocess.Popen(supervisor_args(script(tmp_path, TOY_SCRIPT), storage, "stopped", "100000"),
                                env=driver_env(), stdout=subprocess.PIPE, stderr=stderr, text=True)
        read_until(proc, "REPORTED 2")
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    text = err.read_text()
    assert proc.returncode == 1, text  # the script's TrainingInterruptedError
    assert "TrainingInterruptedError" in text
    assert "the workers checkpoint at their next report" in text
    assert "stopping the workers now" not in text, "passed on once, not twice"
    assert restart_lines(text) == []
    assert notes(text) == ["unbroken run: the command exited with code 1 after SIGTERM was passed on to it; "
                           "not restarting"]
    manifest = run_json(os.path.join(storage, "stopped"))
    assert manifest["status"] == "INTERRUPTED" and len(manifest["attempts"]) == 1
    assert manifest["latest_checkpoint"] is not None
    assert os.path.isfile(os.path.join(storage, "stopped", manifest["latest_checkpoint"], "it.txt"))


def test_a_sweep_whose_driver_is_killed_is_started_again_and_finishes(storage, tmp_path):
    log = str(tmp_path / "faults")
    out = supervise(script(tmp_path, SWEEP_SCRIPT), storage, "sweep",
                    UNBROKEN_FAULT="before_trial_record:1:kill::once", UNBROKEN_FAULT_LOG=log)
    assert out.returncode == 0, out.stderr
    assert open(log).read().split()[0] == "before_trial_record"
    path = os.path.join(storage, "sweep")
    lines = restart_lines(out.stderr)
    assert len(lines) == 1 and lines[0].groups() == ("1", "2", "sweep", path), notes(out.stderr)
    assert sweep_json(path)["status"] == "FINISHED"
    assert statuses(path) == {"trial_00000": "TERMINATED", "trial_00001": "TERMINATED"}


def test_only_the_process_that_opened_the_sweep_records_it(storage, tmp_path):
    """Trial drivers (processes of the sweep driver) open runs too; they record nothing."""
    told = tmp_path / "told.jsonl"
    run_script(SWEEP_SCRIPT, storage, "told", UNBROKEN_SUPERVISED=str(told))
    lines = [json.loads(line) for line in told.read_text().splitlines()]
    assert lines == [{"kind": "sweep", "url": os.path.join(storage, "told")}]


def test_usage_errors(tmp_path):
    for args in ([], ["--"], ["--max-restarts", "-1", "--", "true"], ["--backoff-s", "x", "--", "true"]):
        out = subprocess.run([sys.executable, "-m", "unbroken", "run", *args], env=driver_env(),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, (args, out.stderr)
        assert "usage: unbroken run" in out.stderr
    missing = subprocess.run([sys.executable, "-m", "unbroken", "run", "--", str(tmp_path / "nothing")],
                             env=driver_env(), capture_output=True, text=True, timeout=60)
    assert missing.returncode == 127 and "cannot start" in missing.stderr
