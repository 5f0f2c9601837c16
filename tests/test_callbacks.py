"""Driver-side callbacks: the events they see, failures that must not stop a run, the
progress display, and TensorBoard and MLflow logging that stay clean across resumes."""

import fcntl
import json
import logging
import os
import pty
import re
import socket
import struct
import subprocess
import sys
import termios
import threading
import time

import pytest

from conftest import driver_env, run_script
from toy_loops import toy_loop
from unbroken.train import (
    Callback,
    DataParallelTrainer,
    FailureConfig,
    Result,
    RunConfig,
    TensorBoardLoggerCallback,
    TrainingFailedError,
)


class Recorder(Callback):
    """Records every event with what the run looked like at that moment."""

    def __init__(self):
        self.events = []

    def setup(self, run):
        self.events.append(("setup", run.name, run.run_id, run.config))

    def on_attempt_start(self, run):
        self.events.append(("start", run.attempt, run.resumed_iteration, run.resumed_from))

    def on_result(self, run, metrics):
        metrics["loss"] = "callbacks get a copy"
        self.events.append(("result", metrics["training_iteration"]))

    def on_checkpoint(self, run, checkpoint, metrics):
        assert os.path.isfile(os.path.join(checkpoint.path, "it.txt"))
        self.events.append(("checkpoint", os.path.basename(checkpoint.path), metrics["training_iteration"]))

    def on_attempt_end(self, run, status, error):
        self.events.append(("end", run.attempt, status, type(error).__name__ if error else None))

    def on_run_end(self, run, status):
        run.save_state("recorder", {"events": len(self.events), "seen": run.load_state("recorder")})
        self.events.append(("run_end", status))


class BrokenSetup(Callback):
    def setup(self, run):
        raise RuntimeError("no tracking server")

    def on_result(self, run, metrics):
        raise AssertionError("a callback whose setup failed is not called again")


class BrokenResult(Callback):
    def __init__(self):
        self.calls = 0

    def on_result(self, run, metrics):
        self.calls += 1
        raise ValueError("bad metric")


def trainer(storage, name, config, callbacks, max_failures=0, **run_config):
    run_config.setdefault("verbose", 0)
    return DataParallelTrainer(toy_loop, train_loop_config=config, run_config=RunConfig(
        name=name, storage_path=storage, failure_config=FailureConfig(max_failures=max_failures),
        callbacks=callbacks, **run_config))


def test_callbacks_see_every_event_of_every_attempt_in_order(storage):
    recorder = Recorder()
    config = {"iterations": 7, "fail_at": [[5, 1]]}
    result = trainer(storage, "events", config, [recorder], max_failures=1).fit()
    manifest = json.load(open(os.path.join(result.path, ".unbroken", "run.json")))
    assert recorder.events == [
        ("setup", "events", manifest["run_id"], {"fail_at": [[5, 1]], "iterations": 7}),
        ("start", 1, 0, None),
        ("result", 1), ("result", 2), ("result", 3), ("checkpoint", "checkpoint_000003", 3), ("result", 4),
        ("end", 1, "ERRORED", "RuntimeError"),
        ("start", 2, 3, "checkpoint_000003"),
        ("result", 4), ("result", 5), ("result", 6), ("checkpoint", "checkpoint_000006", 6), ("result", 7),
        ("end", 2, "FINISHED", None),
        ("run_end", "FINISHED"),
    ]
    assert result.metrics["loss"] == pytest.approx(1 / 7 + 0.2), "the recorded row is untouched"
    state = json.load(open(os.path.join(result.path, ".unbroken", "callbacks", "recorder.json")))
    assert state == {"events": 15, "seen": None}


class BackgroundRecorder(Recorder):
    run_in_background = True


class BackgroundBroken(BrokenResult):
    run_in_background = True


class Hangs(Callback):
    """Runs in the background; its third on_result never returns (a server that never answers)."""

    run_in_background = True
    hook_timeout_s = 1.0

    def __init__(self):
        self.calls = 0

    def on_result(self, run, metrics):
        self.calls += 1
        if self.calls == 3:
            threading.Event().wait()


@pytest.mark.parametrize("background", [False, True])
def test_a_failing_callback_is_reported_once_and_the_run_goes_on(storage, caplog, background):
    broken = BackgroundBroken() if background else BrokenResult()
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        result = trainer(storage, "broken", {"iterations": 6}, [BrokenSetup(), broken]).fit()
    assert result.status == "FINISHED" and result.metrics["training_iteration"] == 6
    assert broken.calls == 1, "a callback that raised is not called again in this fit()"
    warnings = [r.getMessage() for r in caplog.records if "callback" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("callback BrokenSetup failed in setup (RuntimeError: no tracking server)")
    name = type(broken).__name__
    assert warnings[1].startswith(f"callback {name} failed in on_result (ValueError: bad metric)")
    assert "not called again in this fit()" in warnings[1]


def test_a_background_callback_sees_the_events_as_they_were(storage):
    recorder = Recorder()
    background = BackgroundRecorder()
    config = {"iterations": 7, "fail_at": [[5, 1]]}
    trainer(storage, "background", config, [recorder, background], max_failures=1).fit()
    assert background.events == recorder.events, "same events, same order, the attempt as it was then"
    assert [t.name for t in threading.enumerate() if t.name.startswith("unbroken-hooks")] == [], \
        "fit() waited for the hooks and let their thread end"


def test_a_hung_background_callback_holds_up_neither_training_nor_fit(storage, caplog):
    hangs = Hangs()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        result = trainer(storage, "hangs", {"iterations": 40}, [hangs]).fit()
    wall = time.monotonic() - t0
    assert result.metrics["training_iteration"] == 40
    assert wall < 1.0 + 8.0, f"fit() took {wall:.1f} s: it waited for the hung hook longer than its bound"
    assert hangs.calls == 3, "not called again once given up"
    warnings = [r.getMessage() for r in caplog.records if "callback Hangs" in r.getMessage()]
    assert warnings == ["callback Hangs on_result has not returned after 1 s; the run goes on without it: "
                        "it is not called again in this fit()"]


def test_callbacks_must_be_callback_instances(storage):
    with pytest.raises(TypeError, match="RunConfig.callbacks must hold Callback or UserCallback instances"):
        trainer(storage, "wrong", {"iterations": 2}, [print]).fit()
    assert not os.path.exists(storage), "refused before anything was written"


def tensorboard_scalars(logdir: str, tag: str) -> list[tuple[int, float]]:
    """What TensorBoard shows for `tag`: its own reader, purges included."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir)
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_shows_one_curve_across_a_retry_and_a_resume(storage):
    config = {"iterations": 8, "fail_at": [[5, 1], [7, 2]]}
    with pytest.raises(TrainingFailedError):
        trainer(storage, "tb", config, [TensorBoardLoggerCallback()]).fit()
    # Auto-resume in a new fit(): attempt 2 fails at 7 and is retried from checkpoint 6.
    result = trainer(storage, "tb", config, [TensorBoardLoggerCallback()], max_failures=1).fit()
    logdir = os.path.join(result.path, "tensorboard")
    assert len(os.listdir(logdir)) == 3, "one event file per attempt"
    timeline = [(int(r["training_iteration"]), r["loss"]) for r in result.rows]
    assert [step for step, _ in timeline] == list(range(1, 9))
    shown = tensorboard_scalars(logdir, "loss")
    assert [step for step, _ in shown] == list(range(1, 9)), "each step once: abandoned rows purged"
    assert [v for _, v in shown] == pytest.approx([v for _, v in timeline], rel=1e-6)
    assert shown[3][1] == pytest.approx(1 / 4 + 0.2), "step 4 as attempt 2 logged it, not attempt 1"
    assert len(tensorboard_scalars(logdir, "acc")) == 8
    # At each attempt's last step, so far; attempt 1's (step 4) purged with its abandoned rows.
    goodput = tensorboard_scalars(logdir, "goodput")
    assert [step for step, _ in goodput] == [6, 8]
    assert goodput[-1][1] == pytest.approx(result.time_spent().goodput, rel=1e-6)


MLFLOW_FIRST = """
import sys
from toy_loops import toy_loop
from unbroken.train import DataParallelTrainer, MLflowLoggerCallback, RunConfig, TrainingFailedError
try:
    DataParallelTrainer(toy_loop, train_loop_config={"iterations": 8, "fail_at": [[5, 1]], "lr": 0.1},
                        run_config=RunConfig(name="mlf", storage_path=sys.argv[1], verbose=0, callbacks=[
                            MLflowLoggerCallback(sys.argv[2], experiment_name="toys")])).fit()
except TrainingFailedError:
    print("FAILED")
"""

MLFLOW_RESUME = """
import json, pickle, sys
from mlflow.tracking import MlflowClient
from unbroken.train import DataParallelTrainer
client = MlflowClient(sys.argv[2])
experiment = client.get_experiment_by_name("toys").experiment_id
before = client.search_runs([experiment])[0]
trainer = DataParallelTrainer.restore(sys.argv[1])
trainer.fit()
callback = trainer.run_config.callbacks[0]
pickle.loads(pickle.dumps(callback))  # the live client is not pickled
runs = client.search_runs([experiment])
print(json.dumps({
    "runs": len(runs), "run_id": runs[0].info.run_id, "status_before": before.info.status,
    "status": runs[0].info.status, "callback_run_id": callback.run_id, "params": runs[0].data.params,
    "name": runs[0].info.run_name,
    "loss": [(m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, "loss")],
    "goodput": [(m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, "goodput")]}))
"""


def test_mlflow_resumes_the_same_run_and_logs_each_step_once(storage, tmp_path):
    uri = f"file://{tmp_path / 'mlruns'}"
    env = {"MLFLOW_ALLOW_FILE_STORE": "true", "MLFLOW_DISABLE_TELEMETRY": "true"}
    assert "FAILED" in run_script(MLFLOW_FIRST, storage, uri, **env).stdout
    path = os.path.join(storage, "mlf")
    saved = json.load(open(os.path.join(path, ".unbroken", "callbacks", "mlflow.json")))
    out = json.loads(run_script(MLFLOW_RESUME, path, uri, **env).stdout.splitlines()[-1])
    assert out["runs"] == 1 and out["run_id"] == saved["run_id"] == out["callback_run_id"]
    assert (out["status_before"], out["status"]) == ("FAILED", "FINISHED")
    assert out["name"] == "mlf"
    assert out["params"] == {"iterations": "8", "fail_at": "[[5, 1]]", "lr": "0.1"}
    steps = [step for step, _ in out["loss"]]
    assert sorted(steps) == list(range(1, 9)), "each step exactly once"
    loss = dict(out["loss"])
    expected = {r["training_iteration"]: r["loss"] for r in Result.from_path(path).rows}
    assert loss == pytest.approx(expected)
    assert loss[4] == pytest.approx(1 / 4 + 0.2), "attempt 1's row 4 (after checkpoint 3) was never sent"
    # Where the run's time went, at the end of each attempt that logged rows, as show prints it.
    goodput = Result.from_path(path).time_spent().goodput
    assert [step for step, _ in out["goodput"]][-1] == 8 and out["goodput"][-1][1] == pytest.approx(goodput)


MLFLOW_UNREACHABLE = """
import json, logging, sys, time
from toy_loops import toy_loop
from unbroken.train import DataParallelTrainer, MLflowLoggerCallback, RunConfig
logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
t0 = time.monotonic()
result = DataParallelTrainer(toy_loop, train_loop_config={"iterations": 32}, run_config=RunConfig(
    name="unreachable", storage_path=sys.argv[1], verbose=0,
    callbacks=[MLflowLoggerCallback(sys.argv[2], timeout_s=2, wait_for_checkpoint=sys.argv[3] == "1")])).fit()
print(json.dumps({"wall": time.monotonic() - t0, "rows": len(result.rows),
                  "slowest": max(r["time_this_iter_s"] for r in result.rows)}))
"""


@pytest.mark.parametrize("server", ["closed port", "never answers"])
def test_an_unreachable_mlflow_server_never_stalls_training(storage, server):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        if server == "never answers":
            sock.listen(64)  # the kernel accepts connections; nobody reads or answers them
        uri = f"http://127.0.0.1:{sock.getsockname()[1]}"
        if server == "closed port":
            sock.close()
        wait = "1" if server == "closed port" else "0"
        proc = run_script(MLFLOW_UNREACHABLE, storage, uri, wait, MLFLOW_DISABLE_TELEMETRY="true")
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["rows"] == 32
    assert out["slowest"] < 1.0, f"an iteration waited {out['slowest']:.1f} s for the logger"
    # The logger is given up 2 s after its stuck call began; fit() waits no longer than that.
    assert out["wall"] < 2.0 + 10.0, f"fit() took {out['wall']:.1f} s"
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("unbroken: callback")]
    assert len(warnings) == 1, proc.stderr
    assert warnings[0].startswith("unbroken: callback MLflowLoggerCallback ")
    assert "the run goes on without it: it is not called again in this fit()" in warnings[0]


PROGRESS_DRIVER = """
import logging, sys
from toy_loops import toy_loop
from unbroken.train import DataParallelTrainer, RunConfig
if sys.argv[3] == "log":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
DataParallelTrainer(toy_loop, train_loop_config={"iterations": 30},
                    run_config=RunConfig(name=sys.argv[2], storage_path=sys.argv[1], verbose=int(sys.argv[4]),
                                         stop={"training_iteration": 30})).fit()
"""


def drive_in_terminal(*args: str) -> str:
    """Run the driver with its stderr on a pseudo-terminal (120 columns); returns what it drew."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-c", PROGRESS_DRIVER, *args], env=driver_env(),
                            stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the driver closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert proc.wait(timeout=120) == 0
    return b"".join(chunks).decode()


def test_progress_line_in_a_terminal_quiet_elsewhere(storage):
    drawn = drive_in_terminal(storage, "tty", "plain", "1")
    final = drawn.rstrip().split("\r")[-1]
    assert final.startswith("tty attempt 1: 100%") and "30/30" in final
    assert re.search(r"\[00:\d\d<00:00, ", final), "elapsed<time left"
    assert "loss=0.1333, acc=1, ckpt=30, FINISHED]" in final


    # Not a terminal and no logging configured: the same lines, through a handler of its own.
    piped = [line for line in run_script(PROGRESS_DRIVER, storage, "piped", "plain", "1").stderr.splitlines()
             if line.startswith("unbroken: run piped: ")]
    assert piped[0].startswith("unbroken: run piped: attempt 1, iteration 1/30, elapsed 00:00:")
    assert re.search(r", elapsed 00:00:\d\d, ETA \d\d:\d\d:\d\d, ", piped[0]), "a known end: an ETA"
    assert piped[-1].endswith(", loss=0.1333, acc=1, ckpt=30: FINISHED") and len(piped) <= 4
    assert run_script(PROGRESS_DRIVER, storage, "piped-quiet", "plain", "0").stderr == "", "verbose=0"
    logged = [line for line in run_script(PROGRESS_DRIVER, storage, "logged", "log", "1").stderr.splitlines()
              if line.startswith("run logged: ")]
    assert logged[0].startswith("run logged: attempt 1, iteration 1/30, elapsed 00:00:")
    assert logged[-1].startswith("run logged: attempt 1, iteration 30/30, elapsed 00:00:")
    assert logged[-1].endswith(", loss=0.1333, acc=1, ckpt=30: FINISHED")
    assert len(logged) <= 4, "the first row, at most one line every 30 s, and the end"
