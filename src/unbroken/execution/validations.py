"""The driver's asynchronous checkpoint validation (Ray Train V2's `ValidationConfig`).

The queue is durable: it is the run's committed checkpoints whose marker asks for a
validation and that have no record yet (`CheckpointManager.pending`, oldest first). One
validation runs at a time, in a process of its own (the engine's `ValidationRunner`: a
local process, or a Ray task), while training goes on; the driver polls it from its loop.
When it ends, its outcome is recorded once (`Run.record_validation`) and the ranks are told.
A driver that dies loses only the validation in flight, which the next driver of the run
runs again; one that is recorded is never run again. A validation that raises is
VALIDATION_FAILED with its error recorded; the training goes on either way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from unbroken.core import faults
from unbroken.core.config import ScalingConfig
from unbroken.core.validation_config import ValidationConfig, resolved
from unbroken.execution.engine.factory import resolve_engine
from unbroken.run.handle import Run
from unbroken.store import validation_record as vr
from unbroken.store.checkpoint import Checkpoint
from unbroken.store.commit import Marker

log = logging.getLogger("unbroken")


class ValidationTask(Protocol):
    """One validation in flight."""

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for it to end; whether it has."""

    def outcome(self) -> tuple[dict[str, Any] | None, str]:
        """Once ended: (the metrics it returned, "") or (None, why it failed)."""

    def cancel(self) -> None:
        """Stop it now (idempotent)."""


# Starts `config.fn(checkpoint, **kwargs)` in its own process.
ValidationRunner = Callable[[ValidationConfig, Checkpoint, dict[str, Any]], ValidationTask]


class Validations:
    """The validations of one run, driven from its driver's loop."""

    def __init__(self, run: Run, config: ValidationConfig | None, runner: ValidationRunner | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.run = run
        self.config = config
        self.runner = runner
        self.clock = clock
        self._task: ValidationTask | None = None
        self._marker: Marker | None = None
        self._deadline: float | None = None
        self._warned = False

    @property
    def busy(self) -> bool:
        """Whether a validation is in flight."""
        return self._task is not None

    def poll(self, wait_s: float = 0.0) -> list[str]:
        """Record the validation in flight if it ended (or ran out of time, waiting up to
        `wait_s` for it), and start the next one. Returns the checkpoint names recorded now."""
        ended: list[str] = []
        if self._task is not None:
            left = wait_s if self._deadline is None else max(0.0, min(wait_s, self._deadline - self.clock()))
            if self._task.wait(left):
                ended.append(self._record(*self._task.outcome()))
            elif self._deadline is not None and self.clock() >= self._deadline:
                ended.append(self._record(None, "", timed_out=True))
        if self._task is None:
            self._start_next()
        return ended

    def wait_all(self) -> list[str]:
        """Run every pending validation to its end (the run is finishing); the names recorded."""
        ended: list[str] = []
        if self._task is None:
            self._start_next()
        while self._task is not None:
            self.run.lease.beat()
            ended += self.poll(wait_s=1.0)
        return ended

    def close(self) -> None:
        """Stop the validation in flight, unrecorded: the run's next driver runs it again."""
        if self._task is not None:
            self._task.cancel()
            self._task = self._marker = None

    def _start_next(self) -> None:
        assert self._task is None, "one validation at a time"
        pending = self.run.checkpoints.pending()
        if not pending:
            return
        if self.config is None:
            if not self._warned:
                self._warned = True
                log.warning("run %s: %d checkpoint(s) wait for a validation, and this trainer has no "
                            "validation_config; they stay PENDING_VALIDATION until a fit() with one "
                            "(e.g. Trainer.restore(path, validation_config=...))",
                            self.run.path, len(pending))
            return
        assert self.runner is not None, "a trainer with a validation_config needs a validation runner"
        marker = pending[0]
        kwargs, timeout = resolved(self.config, marker.validation or {})
        checkpoint = Checkpoint(self.run.storage.url(marker.name), self.run.storage.filesystem_arg)
        self._task = self.runner(self.config, checkpoint, kwargs)
        self._marker = marker
        self._deadline = self.clock() + timeout if timeout is not None else None

    def _record(self, metrics: dict[str, Any] | None, error: str, timed_out: bool = False) -> str:
        assert self._task is not None and self._marker is not None
        name = self._marker.name
        if timed_out:
            self._task.cancel()
            record = vr.ValidationRecord(vr.VALIDATION_TIMEOUT, error="the validation ran out of time "
                                         "(timeout_s) and was stopped", finished_at=time.time())
            log.warning("run %s: the validation of %s ran out of time and was stopped", self.run.path, name)
        elif metrics is None:
            record = vr.ValidationRecord(vr.VALIDATION_FAILED, error=error, finished_at=time.time())
            log.warning("run %s: the validation of %s failed (training goes on): %s", self.run.path, name,
                        error.strip().splitlines()[-1] if error.strip() else "no reason given")
        else:
            record = vr.ValidationRecord(vr.VALIDATED, metrics=metrics, finished_at=time.time())
        self._task = self._marker = None
        faults.point("before_validation_record")
        self.run.record_validation(name, record)
        return name


def validation_runner(scaling: ScalingConfig) -> ValidationRunner:
    """What starts a validation for a run with `scaling`: a Ray task on the Ray engine, a
    process of its own on this machine otherwise."""
    if resolve_engine(scaling) == "ray":
        from unbroken.execution.ray_validation import RayValidation

        return RayValidation
    from unbroken.execution.validation_process import ProcessValidation

    return ProcessValidation
