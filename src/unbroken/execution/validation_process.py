"""The local engine's validations: each one runs `fn(checkpoint, **kwargs)` in a process of
its own on this machine (forked from the driver when that is safe, as workers are), which
dies with the driver and is killed when it runs out of time."""

from __future__ import annotations

import multiprocessing.connection
import os
import traceback
from typing import Any

import cloudpickle

from unbroken.core.processes import Carried, die_with_parent, ignore_terminal_signals
from unbroken.core.validation_config import ValidationConfig
from unbroken.execution.engine.local import start_method
from unbroken.store.checkpoint import Checkpoint
from unbroken.store.history import check_json_metrics


def checked_metrics(value: Any) -> dict[str, Any]:
    """What a validation function returned, if it is a dict of JSON metrics; else TypeError."""
    if not isinstance(value, dict):
        raise TypeError(f"the validation function must return a dict of metrics, got {type(value).__name__}")
    check_json_metrics(value)
    return value


def _validate(payload: Carried, conn: Any, parent_pid: int | None) -> None:
    ignore_terminal_signals()
    die_with_parent(parent_pid)
    fn, checkpoint, kwargs = payload.obj
    if not checkpoint.is_local:
        # An async filesystem (s3fs) inherited through fork is tied to the driver's event loop;
        # a pickle round trip gives this process its own instance (as workers do).
        checkpoint = cloudpickle.loads(cloudpickle.dumps(checkpoint))
    try:
        conn.send((checked_metrics(fn(checkpoint, **kwargs)), ""))
    except BaseException:  # noqa: BLE001 - every failure is the validation's outcome
        conn.send((None, traceback.format_exc()))
    conn.close()
    os._exit(0)  # not the driver's atexit handlers, inherited through fork


class ProcessValidation:
    """One validation in a local process."""

    def __init__(self, config: ValidationConfig, checkpoint: Checkpoint, kwargs: dict[str, Any]) -> None:
        method = start_method()
        ctx = multiprocessing.get_context(method)
        self._conn, child = ctx.Pipe(duplex=False)
        parent = os.getpid() if method == "fork" else None  # a forkserver's child has the server as parent
        self._process = ctx.Process(target=_validate, name="unbroken-validation", daemon=True,
                                    args=(Carried((config.fn, checkpoint, kwargs)), child, parent))
        self._process.start()
        child.close()
        self._result: tuple[dict[str, Any] | None, str] | None = None

    def wait(self, timeout: float) -> bool:
        if self._result is None:
            ready = multiprocessing.connection.wait([self._conn, self._process.sentinel], timeout)
            if not ready:
                return False
            try:
                self._result = self._conn.recv()
            except (EOFError, OSError):
                self._process.join()
                self._result = (None, f"the validation process died (exit code {self._process.exitcode})")
            self._process.join()
        return True

    def outcome(self) -> tuple[dict[str, Any] | None, str]:
        assert self._result is not None
        return self._result

    def cancel(self) -> None:
        if self._process.is_alive():
            self._process.kill()
        self._process.join()
        self._conn.close()
