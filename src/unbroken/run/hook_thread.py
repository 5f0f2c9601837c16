"""One callback's hooks, run in order on a thread of their own, each call bounded in time.

A logger that talks to a service (an MLflow tracking server, a mounted log directory) can
stall for minutes inside its client's retries. Run on the driver's thread, that stall is
the training's: report rounds wait for the driver. Here the driver only queues the call
and goes on; the callback's thread makes the calls one at a time, in the order queued.

The callback is given up, for the rest of the fit(), the first time a call raises, runs
longer than `timeout_s`, or the backlog of queued calls grows past `max_backlog` (a
logger too slow to keep up). `on_give_up` is told why, once; later calls are dropped. A
call that overran is left to finish on its daemon thread, which ends after it.

The thread is named with THREAD_PREFIX, which the local engine counts as safe to fork
past: it runs only callback code, never torch's thread pools, and the locks it may hold
at a fork (logging's, the import lock) are re-initialised in the child by Python.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

THREAD_PREFIX = "unbroken-hooks"
MAX_BACKLOG = 10_000


class HookThread:
    """The queue and thread of one callback (see the module docstring)."""

    def __init__(self, name: str, timeout_s: float, on_give_up: Callable[[str, BaseException | None], None],
                 max_backlog: int = MAX_BACKLOG) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self.max_backlog = max_backlog
        self._on_give_up = on_give_up
        self._queue: deque[tuple[str, Callable[[], None]]] = deque()
        self._cond = threading.Condition()
        self._running: tuple[str, float] | None = None  # (hook, monotonic start) of the call under way
        self._thread: threading.Thread | None = None
        self.given_up = False

    def submit(self, hook: str, call: Callable[[], None]) -> None:
        """Queue one hook call; dropped once the callback is given up."""
        with self._cond:
            self._check_overrun(time.monotonic())
            if self.given_up:
                return
            if len(self._queue) >= self.max_backlog:
                self._give_up(f"fell {len(self._queue)} calls behind the run", None)
                return
            self._queue.append((hook, call))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=f"{THREAD_PREFIX}-{self.name}",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def drain(self) -> None:
        """Wait until every queued call has run, or the callback is given up (a call that
        overruns its bound ends the wait); then let the thread end."""
        with self._cond:
            while not self.given_up and (self._queue or self._running is not None):
                now = time.monotonic()
                if self._check_overrun(now):
                    break
                started = self._running[1] if self._running is not None else now
                self._cond.wait(max(0.01, started + self.timeout_s - now))
            self._queue.clear()
            self.given_up = True  # the thread ends; this fit() makes no more calls
            self._cond.notify_all()

    def _check_overrun(self, now: float) -> bool:
        if self._running is not None and not self.given_up and now - self._running[1] > self.timeout_s:
            self._give_up(f"{self._running[0]} has not returned after {self.timeout_s:g} s", None)
        return self.given_up

    def _give_up(self, why: str, error: BaseException | None) -> None:
        self.given_up = True
        self._queue.clear()
        self._cond.notify_all()
        self._on_give_up(why, error)

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self.given_up:
                    self._cond.wait()
                if self.given_up:
                    return
                hook, call = self._queue.popleft()
                self._running = (hook, time.monotonic())
            error: BaseException | None = None
            try:
                call()
            except Exception as e:
                error = e
            with self._cond:
                self._running = None
                if error is not None and not self.given_up:
                    self._give_up(f"failed in {hook}", error)
                self._cond.notify_all()
