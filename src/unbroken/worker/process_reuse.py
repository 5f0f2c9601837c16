"""What outlives a run in a worker process that its engine keeps for the next run.

A sweep with `TuneConfig(reuse_actors=True)` keeps its trials' worker processes: after a
run ends cleanly, a kept rank waits for the next run (of the same trial or another one)
instead of exiting, so the next one starts with everything imported and set up. The engine
marks such a process (`mark_kept`); a training loop may then leave an object for the next
run in the same process (`keep`, `take`: a class trainable leaves its `Trainable`), and
whatever is still left when the process ends is released then (`release_all`).

An object is taken at most once: a run that takes one owns it, and keeps it again, or
releases it, when it ends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("unbroken")

_kept_process = False
_left: dict[str, tuple[Any, Callable[[], None]]] = {}


def mark_kept() -> None:
    """Called by the engine in a worker process that waits for another run after each one
    that ends cleanly."""
    global _kept_process
    _kept_process = True


def kept() -> bool:
    """Whether this worker process is kept for another run after this one."""
    return _kept_process


def keep(key: str, obj: Any, release: Callable[[], None]) -> None:
    """Leave `obj` under `key` for the next run in this process; `release` is called if no
    run takes it before the process ends (or another object is left under `key`)."""
    if key in _left:
        _release(key)
    _left[key] = (obj, release)


def take(key: str) -> tuple[Any, Callable[[], None]] | None:
    """The object left under `key` and its release, now owned by the caller; None if none."""
    return _left.pop(key, None)


def release_all() -> None:
    """Release everything still left (the process ends)."""
    for key in list(_left):
        _release(key)


def _release(key: str) -> None:
    obj, release = _left.pop(key)
    try:
        release()
    except Exception:  # noqa: BLE001 - the process ends or goes on either way
        log.warning("releasing the %s kept from an earlier run failed", type(obj).__name__, exc_info=True)
