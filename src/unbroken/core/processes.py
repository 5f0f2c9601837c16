"""Helpers for the processes the driver starts on this machine (the local engine's workers,
a sweep's trial drivers): carrying their payload, and dying with their parent.

Engine-neutral code never calls these: a worker of another engine (a long-lived Ray actor)
must not ignore signals on its own, tie its life to a parent, or exit the process.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import cloudpickle


class Carried:
    """Carries a payload to a process that is not forked from the driver (cloudpickle, so
    functions defined in __main__ travel too); under fork it is never pickled at all.
    `on_arrival`, an importable function, runs in the new process before the payload is
    unpickled."""

    def __init__(self, obj: Any, on_arrival: Callable[[], None] | None = None) -> None:
        self.obj = obj
        self.on_arrival = on_arrival

    def __reduce__(self):
        return (_arrive, (cloudpickle.dumps(self.obj), self.on_arrival))


def _arrive(data: bytes, on_arrival: Callable[[], None] | None) -> Carried:
    if on_arrival is not None:
        on_arrival()
    return Carried(cloudpickle.loads(data), on_arrival)


def ignore_terminal_signals() -> None:
    """The driver coordinates shutdown; a Ctrl-C in the terminal must not kill a worker mid-write."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def die_with_parent(parent_pid: int | None) -> None:
    """Linux: the kernel SIGKILLs this process when its parent dies, even by SIGKILL. If the
    parent (`parent_pid`, when known) is already gone, exit now."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)
