"""Preemption: SIGTERM and SIGINT to the driver become a request to checkpoint and stop.

The first signal asks the workers to checkpoint at their next report (their
`should_checkpoint()` turns true); once that round is recorded and its checkpoint
committed, the workers stop and the run is marked INTERRUPTED. A second signal stops
at once. The handlers only count signals and wake the controller through a pipe, so a
signal can never land in the middle of a commit: the controller acts on it between
messages.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

log = logging.getLogger("unbroken")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupts:
    """Counts terminal signals while installed; `fileno()` becomes readable on each one."""

    def __init__(self) -> None:
        self.count = 0
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        os.set_blocking(self._r, False)

    def fileno(self) -> int:
        return self._r

    def drain(self) -> None:
        try:
            while os.read(self._r, 512):
                pass
        except BlockingIOError:
            pass

    def __enter__(self) -> Interrupts:
        # Signal handlers can only be set from the main thread; elsewhere (a driver run
        # from a thread) signals keep their default behaviour.
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            # None: the previous handler was not set from Python (Ray's driver sets one in C);
            # it cannot be put back, and the default ends the process as that one did.
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()
        os.close(self._r)
        os.close(self._w)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        self.signal_name = signal.Signals(signum).name
        try:
            os.write(self._w, b"!")
        except OSError:
            pass
