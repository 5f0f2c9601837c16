"""What the loggers of services that cannot delete a logged point (MLflow, W&B) share: rows
are sent only once they can no longer be abandoned, so that each step is logged once.

A row is held until a checkpoint at its iteration or later commits, or its attempt finishes.
The rows a failed attempt recorded after its last checkpoint are dropped: the next attempt
records those iterations again. With `wait_for_checkpoint=False` rows go out about once a
second as they come, and a failed attempt's rows after its last checkpoint are logged a
second time by the attempt that repeats them.
"""

from __future__ import annotations

import time
from typing import Any

from unbroken.run.callbacks import Callback, RunInfo
from unbroken.store.checkpoint import Checkpoint
from unbroken.store.manifest import FINISHED

LIVE_FLUSH_S = 1.0


class CommittedRowsLogger(Callback):
    """A background logger that sends rows once they are kept (`_send(run, rows)`, one call
    per batch, in order) and the run's time spent at each attempt's end (`_send_time`)."""

    run_in_background = True
    wait_for_checkpoint = True
    _live: tuple[str, ...] = ()  # a subclass's clients: set up again after unpickling, not saved

    def _reset(self) -> None:
        self._pending: list[dict[str, Any]] = []
        self._next_flush = 0.0
        self._last_step = 0  # the step of the last row sent

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for key in ("_pending", "_next_flush", "_last_step", *self._live):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def _send(self, run: RunInfo, rows: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    def _send_time(self, run: RunInfo, scalars: dict[str, float]) -> None:
        """Where the run's time went so far (`Goodput.scalars`), once rows were sent."""

    def on_attempt_start(self, run: RunInfo) -> None:
        self._pending = []

    def on_result(self, run: RunInfo, metrics: dict[str, Any]) -> None:
        self._pending.append(metrics)
        if not self.wait_for_checkpoint:
            now = time.monotonic()
            if now >= self._next_flush:
                self._next_flush = now + LIVE_FLUSH_S
                self._flush(run)

    def on_checkpoint(self, run: RunInfo, checkpoint: Checkpoint, metrics: dict[str, Any]) -> None:
        self._flush(run)

    def on_attempt_end(self, run: RunInfo, status: str, error: BaseException | None) -> None:
        if status == FINISHED or not self.wait_for_checkpoint:
            self._flush(run)
        self._pending = []
        if self._last_step:
            self._send_time(run, run.time_spent().scalars())

    def _flush(self, run: RunInfo) -> None:
        if not self._pending:
            return
        rows, self._pending = self._pending, []
        self._send(run, rows)
        self._last_step = int(rows[-1]["training_iteration"])


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested train_loop_config as `a.b.c` keys (objects, shown as {"__object__": ...}, kept whole)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and "__object__" not in value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out
