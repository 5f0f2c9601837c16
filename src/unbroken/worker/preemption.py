"""A rank's side of a preemption (the driver's is `unbroken.execution.notices`).

- A SIGTERM to a local worker process is a notice, not an end: the rank tells the driver
  (`Terminating`), which stops the attempt at a checkpoint before the grace period runs out.
- SIGUSR2 from the driver (`ABANDON_SIGNAL`) gives the rank's step up when the deadline is
  near and the rank has not reported since the notice: the training loop raises
  `StepAbandoned` where it is, and the rank ends as a failed one does, offering the state of
  its last report for a just-in-time checkpoint (`unbroken.worker.recovery.just_in_time`), clean unless its
  optimizer step had begun. Outside the training loop (a save, set-up) the signal is ignored.
- `train.get_preemption_info()` reads what the driver's replies said (`Reply.preemption`),
  so every rank sees the same answer at the same report.
Both handlers act only in the process that armed them, not in its children (DataLoader
workers inherit Python's handlers through fork).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

from unbroken.worker import session as session_mod
from unbroken.worker.protocol import Terminating

ABANDON_SIGNAL = signal.SIGUSR2
_armed_pid: list[int] = []  # the process whose handlers act
_in_loop: list[int | None] = [None]  # the thread running the training loop, while it runs


class StepAbandoned(BaseException):
    """Raised in a rank's training loop when the driver gives its step up before a
    preemption's deadline. A BaseException, so that a loop's `except Exception` lets it by."""


def arm(notify_on_sigterm: bool) -> None:
    """In a worker process, once: SIGUSR2 abandons the step in the training loop; with
    `notify_on_sigterm` (a local worker), SIGTERM sends the driver a `Terminating`."""
    _armed_pid[:] = [os.getpid()]
    signal.signal(ABANDON_SIGNAL, _abandon)
    if notify_on_sigterm:
        signal.signal(signal.SIGTERM, _notify)


@contextlib.contextmanager
def in_training_loop() -> Iterator[None]:
    """While the user's training loop runs: the part a step may be abandoned in (only where it
    runs in the main thread, where Python runs signal handlers)."""
    _in_loop[0] = threading.get_ident()
    try:
        yield
    finally:
        _in_loop[0] = None


def _abandon(signum: int, frame: FrameType | None) -> None:
    if _armed_pid == [os.getpid()] and _in_loop[0] == threading.get_ident():
        _in_loop[0] = None  # once: the loop's way out (its finally blocks, the offer) runs unhindered
        raise StepAbandoned("the driver gave this rank's step up: the machine is preempted before the "
                            "step could end; the last report round is saved just in time instead")


def _notify(signum: int, frame: FrameType | None) -> None:
    session = session_mod.active()
    if _armed_pid != [os.getpid()] or session is None:
        return
    # Sent from a thread: the loop may be inside a send of its own, holding the channel.
    threading.Thread(target=_send, args=(session, Terminating("SIGTERM", time.time())), daemon=True).start()


def _send(session: Any, notice: Terminating) -> None:
    with contextlib.suppress(OSError, EOFError, ValueError):
        session.send(notice)
