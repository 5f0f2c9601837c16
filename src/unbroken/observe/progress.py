"""What the driver shows while fit() runs.

In a terminal (stderr is a TTY) and with `RunConfig(verbose>=1)`: one live status line
per attempt (tqdm), with the iteration, a few metrics, the elapsed time, the latest
checkpoint and the attempt; it stays on screen when the attempt ends, with its status.
Elsewhere, with `verbose=1`: an INFO line on the "unbroken" logger at the first row, at
most every 30 s after that, and when the attempt ends; where nobody configured logging,
the logger gets a handler that writes those lines to stderr (`ensure_log_output`), so
that a run whose output is redirected, in CI or in a notebook still shows its progress.
Both show the total and an estimate of the time left when the run has a known end
(`RunConfig(stop={"training_iteration": N})`). `verbose=0` shows nothing.

Report rounds can come thousands of times a second, so the display redraws at most four
times a second; a round that does not redraw costs it one clock read.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

from unbroken.core.config import RunConfig
from unbroken.run.callbacks import TIMINGS, Callback, RunInfo, numeric_metrics
from unbroken.store.checkpoint import Checkpoint

log = logging.getLogger("unbroken")

REFRESH_S = 0.25
LOG_EVERY_S = 30.0
MAX_METRICS = 4


def is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class ProgressReporter(Callback):
    """The live status line (terminal) or the occasional log line (elsewhere) of one fit()."""

    def __init__(self, run_config: RunConfig) -> None:
        self.verbose = run_config.verbose
        stop = run_config.stop
        self.total = int(stop["training_iteration"]) if isinstance(stop, dict) and \
            "training_iteration" in stop else None
        self._bar: Any = None
        self._row: dict[str, Any] | None = None
        self._next_draw = 0.0
        self._checkpoint: str | None = None
        self._t0 = 0.0
        if self.verbose == 1 and not is_terminal(sys.stderr):
            ensure_log_output()  # from the start: a lease takeover's warning is shown the same way

    def on_attempt_start(self, run: RunInfo) -> None:
        self._row, self._next_draw, self._t0 = None, 0.0, time.monotonic()
        self._checkpoint = run.resumed_from
        if is_terminal(sys.stderr):
            self._bar = _make_bar(total=self.total, initial=run.resumed_iteration,
                                  desc=f"{run.name} attempt {run.attempt}")

    def on_result(self, run: RunInfo, metrics: dict[str, Any]) -> None:
        self._row = metrics
        now = time.monotonic()
        if now >= self._next_draw:
            self._draw(run, now)

    def on_checkpoint(self, run: RunInfo, checkpoint: Checkpoint, metrics: dict[str, Any]) -> None:
        self._checkpoint = checkpoint.path.rstrip("/").rsplit("/", 1)[-1]

    def on_attempt_end(self, run: RunInfo, status: str, error: BaseException | None) -> None:
        self._draw(run, time.monotonic(), status)
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _summary(self) -> list[str]:
        row = self._row or {}
        shown = [(k, v) for k, v in numeric_metrics(row).items()
                 if k not in TIMINGS]
        parts = [f"{k}={format_value(v)}" for k, v in shown[:MAX_METRICS]]
        if self._checkpoint:
            parts.append(f"ckpt={self._checkpoint.removeprefix('checkpoint_').lstrip('0') or '0'}")
        if "straggler_rank" in row:
            parts.append(f"slow: rank {row['straggler_rank']} ({row['straggler_ratio']:.1f}x)")
        return parts

    def _draw(self, run: RunInfo, now: float, status: str | None = None) -> None:
        bar = self._bar
        self._next_draw = now + (REFRESH_S if bar is not None else LOG_EVERY_S)
        if bar is not None:
            if self._row is not None:
                bar.n = self._row.get("training_iteration", bar.n)
            bar.set_postfix_str(", ".join(self._summary() + ([status] if status else [])), refresh=False)
            bar.refresh()
        elif self.verbose == 1 and log.isEnabledFor(logging.INFO):
            iteration = (self._row or {}).get("training_iteration", run.resumed_iteration)
            position = f"{iteration}/{self.total}" if self.total else f"{iteration}"
            eta = ""
            if self.total and status is None:
                left = eta_s(now - self._t0, iteration - run.resumed_iteration, self.total - iteration)
                eta = f", ETA {clock(left)}" if left is not None else ""
            log.info("run %s: attempt %d, iteration %s, elapsed %s%s%s%s", run.name, run.attempt, position,
                     clock(now - self._t0), eta, "".join(f", {p}" for p in self._summary()),
                     f": {status}" if status else "")


def clock(seconds: float) -> str:
    """hh:mm:ss"""
    s = int(seconds)
    return f"{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}"


def sweep_progress(done: int, running: int, total: int, elapsed_s: float, ended_here: int) -> str:
    """"3/10 done, 2 running, 5 pending, ETA 00:04:10": where a sweep stands, and the time
    left at the pace of the `ended_here` trials its driver saw end in `elapsed_s`."""
    text = f"{done}/{total} done, {running} running, {max(0, total - done - running)} pending"
    left = eta_s(elapsed_s, ended_here, total - done) if ended_here else None
    if left is not None and done < total:
        text += f", ETA {clock(left)}"
    return text


def eta_s(elapsed: float, done: int, left: int) -> float | None:
    """Seconds still needed for `left` more units at the rate of the `done` ones so far, or
    None before the first one is done."""
    if done <= 0 or elapsed <= 0:
        return None
    return max(0, left) * elapsed / done


def ensure_log_output() -> None:
    """Where neither the "unbroken" logger nor any logger above it has a handler (nobody
    configured logging), give it one that writes its INFO lines to stderr. Logging that was
    configured is left as it is: its handlers and levels decide."""
    if log.hasHandlers():
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("unbroken: %(message)s"))
    log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


def _make_bar(**kwargs: Any) -> Any:
    from tqdm import tqdm

    class Bar(tqdm):
        monitor_interval = 0  # no monitor thread: a thread in the driver makes workers slower to start

    Bar.set_lock(threading.RLock())  # not tqdm's default multiprocessing lock
    try:
        sized = min(os.get_terminal_size(sys.stderr.fileno())) > 0
    except (OSError, ValueError):
        sized = False
    size = {"dynamic_ncols": True} if sized else {"ncols": 100, "nrows": 24}  # else tqdm draws nothing
    return Bar(unit="it", file=sys.stderr, leave=True, mininterval=0, **size, **kwargs)
