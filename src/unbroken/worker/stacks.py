"""Every thread's Python stack of a hung rank, captured before its group is torn down.

Each worker process arms `faulthandler` on SIGUSR1 when it starts (`arm`, called by the
engine's process wrapper), to write all its threads' stacks into a file of its own in its
machine's temporary directory (`stack_file(pid)`). When `hang_timeout_s` fires, the driver
(local engine), or a task on the rank's node (Ray engine), sends the signal and reads what
was written (`dump`). faulthandler writes from the signal handler itself, in C, so a rank
blocked in a collective or in C code answers; a stopped process (SIGSTOP) does not.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import tempfile
import time
from typing import Any

SIGNAL = signal.SIGUSR1
_armed: list[Any] = []  # the open file, kept for the process's life (faulthandler holds its fd)


def stack_file(pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"unbroken-stacks-{pid}.txt")


def arm() -> None:
    """Write every thread's stack to a new `stack_file(os.getpid())` on SIGUSR1 from now on
    (a Ray actor that runs rank after rank arms again for each)."""
    f = open(stack_file(os.getpid()), "w")  # noqa: SIM115 - open while armed
    faulthandler.register(SIGNAL, file=f, all_threads=True, chain=False)
    while _armed:
        _armed.pop().close()
    _armed.append(f)


def dump(pid: int, wait_s: float = 2.0) -> str | None:
    """Signal process `pid` (on this machine) and return the stacks it wrote, or None when it
    is gone, was never armed, or wrote nothing within `wait_s` (stopped). The file is removed."""
    path = stack_file(pid)
    try:
        before = os.path.getsize(path)
        os.kill(pid, SIGNAL)
    except OSError:
        return None
    deadline, size = time.monotonic() + wait_s, before
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = os.path.getsize(path)
        if now > before and now == size:  # written, and no longer growing
            break
        size = now
    with open(path) as f:
        f.seek(before)
        text = f.read()
    forget(pid)
    return text or None


def forget(pid: int) -> None:
    """Remove process `pid`'s stack file (it ended, or its stacks were read)."""
    with contextlib.suppress(OSError):
        os.remove(stack_file(pid))


def where(text: str) -> str:
    """The innermost frame of the signalled (main) thread, and the innermost one outside torch
    and unbroken when that is another: 'loops.py:75 in linear_loop (in threading.py:629 in wait)'."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), 0)
    frames = []
    for line in lines[start + 1:]:
        if not line.startswith("  File "):
            break
        path, _, rest = line[len('  File "'):].partition('", line ')
        number, _, function = rest.partition(" in ")
        frames.append((path, f"{os.path.basename(path)}:{number} in {function}"))
    if not frames:
        return "unknown"
    own = next((label for path, label in frames
                if not any(part in path for part in ("site-packages", f"{os.sep}unbroken{os.sep}",
                                                     f"{os.sep}torch{os.sep}", f"{os.sep}python3."))), None)
    innermost = frames[0][1]
    return innermost if own in (None, innermost) else f"{own} (in {innermost})"
