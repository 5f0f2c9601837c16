"""Torch-free trainables for the sweep tests (importable, so saved by reference, and cheap
to import in a driver subprocess)."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time

from unbroken import tune
from unbroken.train import Callback, Checkpoint
from unbroken.tune.result import SHOULD_CHECKPOINT

BLOCK_ENV = "TUNE_TEST_BLOCK_DIR"
ACTIVE_ENV = "TUNE_TEST_ACTIVE_DIR"


def tune_loop(config: dict) -> None:
    """Reports `iterations` rows of score = x * it + y (x, y from the config), with a
    checkpoint every `ckpt_every` iterations (and when asked to, on preemption), resuming from
    the latest one.

    Knobs in the config: fail_x=v raises at iteration 2 in attempt 1 of trials with x == v;
    fail_once=path raises at iteration 2 unless `path` exists (and creates it); echo prints
    "<trial> REPORTED it"; cap=c reports x * min(it, c) + y (a plateau from c on); step_s=s
    makes each iteration take s seconds of work. Knobs in the environment, so that the configs stay the same:
    $TUNE_TEST_BLOCK_DIR: a trial whose name is a FIFO there prints "<trial> BLOCKING" after
    the report of iteration `block_it` (default 2) and blocks reading it;
    $TUNE_TEST_ACTIVE_DIR: each running trial keeps a file there, and the number of them at
    each trial's start is appended to <dir>/max.
    """
    ctx = tune.get_context()
    trial = ctx.get_trial_name() or ctx.get_experiment_name()
    attempt = ctx.get_attempt()
    active = os.environ.get(ACTIVE_ENV)
    if active:
        _enter(active, trial)
    try:
        start = 0
        ckpt = tune.get_checkpoint()
        if ckpt is not None:
            with ckpt.as_directory() as d, open(os.path.join(d, "it.txt")) as f:
                start = int(f.read())
        x, y = config.get("x", 1), config.get("y", 0.0)
        for it in range(start + 1, config.get("iterations", 4) + 1):
            if config.get("fail_x") == x and it == 2 and attempt == 1:
                raise RuntimeError(f"injected failure in {trial} at iteration {it}")
            if config.get("fail_once") and it == 2 and not os.path.exists(config["fail_once"]):
                open(config["fail_once"], "w").close()
                raise RuntimeError(f"injected one-time failure in {trial} at iteration {it}")
            if config.get("step_s"):
                time.sleep(config["step_s"])  # the iteration's work
            metrics = {"score": x * min(it, config.get("cap", it)) + y, "it": it}
            if it % config.get("ckpt_every", 1) == 0 or ctx.should_checkpoint():
                with tempfile.TemporaryDirectory() as d:
                    with open(os.path.join(d, "it.txt"), "w") as f:
                        f.write(str(it))
                    tune.report(metrics, checkpoint=Checkpoint.from_directory(d))
            else:
                tune.report(metrics)
            if config.get("echo"):
                print(f"{trial} REPORTED {it}", flush=True)
            block = os.path.join(os.environ.get(BLOCK_ENV) or "/nonexistent", trial)
            if it == config.get("block_it", 2) and os.path.exists(block):
                print(f"{trial} BLOCKING", flush=True)
                with open(block) as f:
                    f.read()
    finally:
        if active:
            _leave(active, trial)


def _enter(active: str, trial: str) -> None:
    os.makedirs(active, exist_ok=True)
    open(os.path.join(active, f"{trial}.running"), "w").close()
    now = len([n for n in os.listdir(active) if n.endswith(".running")])
    with open(os.path.join(active, "max"), "a") as f:
        f.write(f"{now}\n")


def _leave(active: str, trial: str) -> None:
    os.remove(os.path.join(active, f"{trial}.running"))


def max_running(active: str) -> int:
    with open(os.path.join(active, "max")) as f:
        return max(int(line) for line in f if line.strip())


def asha_loop(config: dict) -> None:
    """tune_loop with 8 iterations by default (ASHA stops it earlier)."""
    tune_loop({"iterations": 8, **config})


def must_not_run(config: dict) -> None:
    raise AssertionError("a trial ran that should not have")


def write_config(config: dict) -> None:
    """Reports the config it got (JSON) as one row: for checking merges and contexts."""
    ctx = tune.get_context()
    tune.report({"config": json.dumps(config, sort_keys=True, default=repr),
                 "trial_name": ctx.get_trial_name(), "trial_id": ctx.get_trial_id(),
                 "experiment_name": ctx.get_experiment_name()})


class Payload:
    """A constant param_space value that is not plain data (pickled with the sweep)."""

    def __init__(self, n: int) -> None:
        self.n = n


def returning(config: dict):
    """Reports config["case"]["reports"] rows (score = it, a checkpoint each, resuming from the
    latest), then returns config["case"]["ret"]: what Ray Tune reports as the final result."""
    case = config["case"]
    start = 0
    ckpt = tune.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d, open(os.path.join(d, "it.txt")) as f:
            start = int(f.read())
    for it in range(start + 1, case.get("reports", 0) + 1):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "it.txt"), "w") as f:
                f.write(str(it))
            tune.report({"score": it}, checkpoint=Checkpoint.from_directory(d))
    return case.get("ret")


def yielding(config: dict):
    """A generator trainable: yields three dicts, then a number, then returns a value (ignored)."""
    for it in range(1, 4):
        yield {"score": it * config.get("x", 1)}
    yield 7
    return {"score": 1000}


class KillTrialDriverOnce(Callback):
    """SIGKILLs the process it runs in -- a trial's driver, where callbacks run -- right after a
    row holding `key` is recorded; only once: `marker` is created first."""

    def __init__(self, key: str, marker: str) -> None:
        self.key, self.marker = key, marker

    def on_result(self, run, metrics: dict) -> None:
        if self.key in metrics and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def param_loop(config: dict, data: bytes) -> None:
    """tune_loop, with y the checksum of `data` (given by tune.with_parameters) modulo 1000."""
    import zlib

    tune_loop({**config, "y": zlib.crc32(data) % 1000})


def gpu_env_loop(config: dict) -> None:
    """Reports the GPUs its process sees (CUDA_VISIBLE_DEVICES), while counted as running."""
    ctx = tune.get_context()
    active = os.environ.get(ACTIVE_ENV)
    trial = ctx.get_trial_name()
    if active:
        _enter(active, trial)
    try:
        tune.report({"gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "")})
        tune.report({"gpus": os.environ.get("CUDA_VISIBLE_DEVICES", ""), "done": 1})
    finally:
        if active:
            _leave(active, trial)


class Counter(tune.Trainable):
    """A class trainable: each step adds x to a running total (score), for `iterations` steps
    (then done=True); the steps listed in `ckpt_at` ask for a checkpoint (should_checkpoint).
    Its state is saved as a dict, or, with x == 2, as a file it writes. With
    $TUNE_TEST_BLOCK_DIR holding a FIFO named after the trial, it prints "<trial> BLOCKING"
    after step `block_it` (default 3) was reported and blocks reading it."""

    def setup(self, config: dict, offset: int = 0) -> None:
        self.x, self.total = config.get("x", 1), offset

    def step(self) -> dict:
        block = os.path.join(os.environ.get(BLOCK_ENV) or "/nonexistent", self.trial_name or "")
        if self.iteration == self.config.get("block_it", 3) and os.path.exists(block):
            print(f"{self.trial_name} BLOCKING", flush=True)
            with open(block) as f:
                f.read()
        self.total += self.x
        out = {"score": self.total, "it": self.iteration + 1,
               "done": self.iteration + 1 >= self.config.get("iterations", 6)}
        if self.iteration + 1 in self.config.get("ckpt_at", ()):
            out[SHOULD_CHECKPOINT] = True
        return out

    def save_checkpoint(self, checkpoint_dir: str):
        if self.x == 2:
            with open(os.path.join(checkpoint_dir, "total.txt"), "w") as f:
                f.write(str(self.total))
            return None
        return {"total": self.total}

    def load_checkpoint(self, checkpoint) -> None:
        if isinstance(checkpoint, str):
            with open(os.path.join(checkpoint, "total.txt")) as f:
                self.total = int(f.read())
        else:
            self.total = checkpoint["total"]


def pbt_loop(config: dict) -> None:
    """A trial population-based training can improve: a weight that grows by the trial's `lr`
    each step (score = the weight), checkpointed at every report and resumed from the latest
    checkpoint, whose weight and step it takes. Deterministic."""
    w, start = 0.0, 0
    ckpt = tune.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d, open(os.path.join(d, "state.json")) as f:
            saved = json.load(f)
        w, start = saved["w"], saved["step"]
    for step in range(start + 1, config.get("iterations", 8) + 1):
        w = round(w + config["lr"], 6)
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "state.json"), "w") as f:
                json.dump({"w": w, "step": step}, f)
            tune.report({"score": w, "lr": config["lr"], "step": step},
                        checkpoint=Checkpoint.from_directory(d))
        if config.get("echo"):
            print(f"{tune.get_context().get_trial_name()} REPORTED {step}", flush=True)


class Recorder(tune.Callback):
    """A sweep callback that appends each event it is given to the JSON-lines file `path`
    (it survives a killed sweep driver), and prints it. Its state is the events it noted: a
    restored sweep gives it back, and the file is cut to them, dropping what a killed driver
    told it after its last save (told again after the restore, as Tune does)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.noted: list = []

    def get_state(self) -> dict:
        return {"noted": self.noted}

    def set_state(self, state: dict) -> None:
        self.noted = state["noted"]
        with open(self.path, "w") as f:
            f.writelines(json.dumps(event) + "\n" for event in self.noted)

    def _note(self, *event) -> None:
        self.noted.append(list(event))
        line = json.dumps(event)
        with open(self.path, "a") as f:
            f.write(line + "\n")
        print("EVENT", line, flush=True)

    def setup(self, stop=None, num_samples=None, total_num_samples=None, **info) -> None:
        self._note("setup", total_num_samples)

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        self._note("start", str(trial))

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        self._note("result", trial.trial_name, result["training_iteration"], result["score"])

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self._note("complete", trial.trial_name, trial.last_result.get("training_iteration"))

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self._note("error", trial.trial_name, bool(trial.error))

    def on_experiment_end(self, trials, **info) -> None:
        self._note("end", sorted(t.status for t in trials))


REUSE_LOG_ENV = "TUNE_TEST_REUSE_LOG"


def _note(what: str, config: dict) -> None:
    """Append "<what> <pid> <lr>" to $TUNE_TEST_REUSE_LOG, when set: the reuse tests count
    processes and calls."""
    log = os.environ.get(REUSE_LOG_ENV)
    if log:
        with open(log, "a") as f:
            f.write(f"{what} {os.getpid()} {config.get('lr')}\n")


def noted_pbt_loop(config: dict) -> None:
    """`pbt_loop`, noting each run ("run") with the process it runs in."""
    _note("run", config)
    pbt_loop(config)


class Resettable(tune.Trainable):
    """`pbt_loop` as a class trainable (a weight that grows by lr each step), noting setup,
    reset_config, load_checkpoint and cleanup with their process; reset_config takes the new
    config unless the config says `resets: False`."""

    def setup(self, config: dict) -> None:
        self.w = 0.0
        _note("setup", config)

    def step(self) -> dict:
        self.w = round(self.w + self.config["lr"], 6)
        return {"score": self.w, "lr": self.config["lr"], "step": self.iteration + 1}

    def save_checkpoint(self, checkpoint_dir: str) -> dict:
        return {"w": self.w}

    def load_checkpoint(self, checkpoint: dict) -> None:
        self.w = checkpoint["w"]
        _note("load", self.config)

    def reset_config(self, new_config: dict) -> bool:
        _note("reset", new_config)
        return new_config.get("resets", True)

    def cleanup(self) -> None:
        _note("cleanup", self.config)
