"""Fault injection for crash tests: `UNBROKEN_FAULT=<point>[:<n>[:<action>[:<rank>[:once]]]]`
strikes this process the n-th time (default: first) it passes `point`. The action is `kill` (SIGKILL,
the default), `exit` (`os._exit(3)`, no clean-up), `raise` (InjectedFault, as if the code
right after the point raised), `stop` (SIGSTOP: a frozen process, which answers nothing
until it is killed) or `block` (waits for ever in Python, as a deadlocked rank). With a
rank, only the worker of that world rank is struck. Several specs, separated by commas, each
strike at their own point (e.g. a rank killed after a report, and then the survivor during
its just-in-time save). With
`UNBROKEN_FAULT_LOG=<file>` it first appends the point's name and pid to that file, so a
harness can tell an injected fault from a real failure; `once` then strikes only if that file
has no strike of the point yet (a rank started again in a new process does not strike again).
Costs one environment lookup when unset.

The points, in protocol order: after_file_write, after_fsync (worker, per rank);
before_marker, after_marker, before_rename, after_rename (driver, commit);
before_delete, during_delete (driver, retention); before_replace (any atomic file
replace: run.json, result rows, lease); after_report (worker, right after it sent a report);
during_jit_save (the worker saving a just-in-time checkpoint, between its files: see
`worker.recovery.just_in_time`); during_copy_rename (a directory moved on an object store, where it is copied
file by file and then removed: after each file copied, e.g. a torn checkpoint set aside);
before_trial_record (sweep driver, when a trial's process has ended and before sweep.json
records how the trial ended); after_fold (object stores: result.json rewritten with its
parts folded in, before the parts are removed; see `store.appender`); before_validation_record
(driver: a checkpoint's validation ended and its record is not written yet; see
`execution.validations`); after_resize_stop (driver: an elastic run's attempt stopped at the
checkpoint it asked for, to grow, and the next attempt has not started); during_peer_share
(worker: an attempt recovering in place, between the size and the state of the transfer,
see `worker.recovery.peer_state`); before_attach_staged (worker: a stopped class trainable's
`checkpoint_at_end` files are staged and the driver not told yet; see `report_pipeline`).
"""

from __future__ import annotations

import os
import signal
import threading

_counts: dict[str, int] = {}  # passes of each point named in UNBROKEN_FAULT so far


class InjectedFault(RuntimeError):
    """Raised by a fault point whose action is `raise`."""


def carried_env() -> dict[str, str]:
    """The fault settings of this (driver) process, for workers that do not inherit its
    environment (the Ray engine's actors)."""
    return {k: v for k in ("UNBROKEN_FAULT", "UNBROKEN_FAULT_LOG") if (v := os.environ.get(k))}


def point(name: str) -> None:
    spec = os.environ.get("UNBROKEN_FAULT")
    if not spec:
        return
    for one in spec.split(","):
        target, _, rest = one.partition(":")
        if name == target:
            _strike(name, rest)


def _strike(name: str, rest: str) -> None:
    """Count a pass of `name` and strike when the spec's count, action and rank say so."""
    _counts[name] = count = _counts.get(name, 0) + 1
    n, _, rest = rest.partition(":")
    action, _, rest = rest.partition(":")
    rank, _, once = rest.partition(":")
    if rank and os.environ.get("RANK") != rank:
        return
    if count >= int(n or 1):
        log = os.environ.get("UNBROKEN_FAULT_LOG")
        if once and log and os.path.exists(log) and any(
                line.split()[0] == name for line in open(log).read().splitlines() if line):
            return  # struck already, in this process or another (a rank started again)
        if log:
            with open(log, "a") as f:
                f.write(f"{name} {os.getpid()}\n")
        if action == "raise":
            raise InjectedFault(f"injected fault at {name}")
        if action == "exit":
            os._exit(3)
        if action == "block":
            threading.Event().wait()
        os.kill(os.getpid(), signal.SIGSTOP if action == "stop" else signal.SIGKILL)
