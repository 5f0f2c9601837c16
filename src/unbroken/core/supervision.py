"""Telling `unbroken run` (the supervisor, `cli.supervisor`) which run or sweep its child opened.

The supervisor starts its command with `UNBROKEN_SUPERVISED=<file>` in the environment. The
first process of that command that imports this module takes the variable: it removes it
from `os.environ`, so that the processes it starts afterwards (a sweep's trial drivers, the
workers, anything else) never see it, and keeps the file here, with its own pid, so that a
process forked from it (which inherits this module's state, not the variable) records nothing
either. When that process opens a run (`train.open_run`, once the run is leased) or a sweep
(`Tuner.fit`, once the sweep is leased), it appends one line of JSON to the file:

    {"kind": "run", "url": "<the run directory, as Storage.from_url opens it>"}

The supervisor reads these lines after its child has ended and decides from the manifests
they point to whether starting the command again can help. Being told by the run itself, and
not by parsing the child's output, it is never fooled by what a script prints.

Costs one environment lookup at import when unset; recording never raises (a supervisor that
cannot be told does not restart, and training goes on either way).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

ENV = "UNBROKEN_SUPERVISED"
RUN, SWEEP = "run", "sweep"

log = logging.getLogger("unbroken")

# (pid of the process that took the variable, the file it names), or None when unsupervised.
_taken: tuple[int, str] | None = None


def _take() -> None:
    """Take UNBROKEN_SUPERVISED out of this process's environment, once, at import."""
    global _taken
    value = os.environ.pop(ENV, None)
    if value and _taken is None:
        _taken = (os.getpid(), value)


_take()


def supervised() -> bool:
    """True in the one process that records for a supervisor."""
    return _taken is not None and _taken[0] == os.getpid()


def record(kind: str, url: str) -> None:
    """Tell the supervisor, if any, that this process opened the run or sweep at `url` (`kind`:
    RUN or SWEEP). Only the process that took the variable records; one short append, flushed."""
    if not supervised():
        return
    assert _taken is not None
    line = json.dumps({"kind": kind, "url": url}) + "\n"
    try:
        fd = os.open(_taken[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError as e:
        log.warning("could not tell the supervisor (`unbroken run`) that this process opened %s %s: %s",
                    kind, url, e)


def recorded(path: str) -> list[dict[str, Any]]:
    """What a supervised command recorded in `path`, in order (none if it wrote nothing).
    A line cut short by a process killed while writing it is skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("kind") in (RUN, SWEEP) and isinstance(entry.get("url"),
                                                                                             str):
            out.append(entry)
    return out
