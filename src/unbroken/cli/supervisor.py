"""`unbroken run [--max-restarts N] [--backoff-s S] -- CMD ...`: run a training script as a
child process and start it again when its driver dies, so that it resumes its run by name.

Why a separate process: a driver killed with SIGKILL (an OOM kill, a reclaimed machine, a
`kill -9`) cannot bring itself back; the library makes the run restorable, and this brings
the script back to restore it, without a person watching.

- **When it restarts.** The child dies by a signal or exits non-zero, and the run or sweep
  it opened is not finished. The child tells which one it opened through the run itself
  (`core.supervision`: `UNBROKEN_SUPERVISED=<file>`, one JSON line per run or sweep leased),
  never through its output; the supervisor then reads the run's or sweep's manifest. A
  launch that opened nothing (it failed before: a changed configuration, bad input, an
  ImportError; unbroken raises those before it writes or leases anything), a run or sweep
  that FINISHED (or a sweep left INCOMPLETE on purpose) and a launch after N restarts
  (`--max-restarts`, 3 by default) are not started again: the supervisor exits with the
  child's code (128+s for a signal s).
  A status it cannot read (storage it cannot open) counts as unfinished: the script, run
  again, decides, and a finished run opens nothing, so the restarts end there.
- **Backoff.** The first restart waits `--backoff-s` (1 s by default), each later one twice
  as long, 60 s at most. Each restart prints one line to stderr.
- **Signals.** SIGTERM and SIGINT to the supervisor are passed on to the child, once each
  (the library turns the first into "checkpoint at the next report, then stop", the run
  INTERRUPTED), and the supervisor restarts nothing after one. The child runs in a process
  group of its own, so a Ctrl-C in the terminal (or a signal to the supervisor's process
  group) reaches it only this way, once, not twice; and it dies with the supervisor
  (PDEATHSIG), as a sweep's trial drivers do with theirs. So the command must not read from
  the terminal (a background process group that does is stopped). A tool that signals every
  process of the job one by one (`ray job stop`, systemd's control-group kill) reaches the
  driver both directly and through the supervisor; the driver takes the second signal as
  "stop at once", from its last committed checkpoint.
- **Ray jobs.** `ray job submit -- unbroken run -- python train.py` needs nothing more: the
  supervisor and its child run where the job's entrypoint runs, and die with it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from unbroken.core import supervision
from unbroken.store import manifest as mf
from unbroken.store import sweep_manifest as sw
from unbroken.store.lease import live_holder
from unbroken.store.storage import Storage

DEFAULT_MAX_RESTARTS = 3
DEFAULT_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
PREFIX = "unbroken run:"

_TERMINAL = (signal.SIGTERM, signal.SIGINT)
_WAITED = {signal.SIGTERM, signal.SIGINT, signal.SIGCHLD}
# Statuses from which running the script again cannot get further.
_FINAL = {supervision.RUN: {mf.FINISHED}, supervision.SWEEP: {sw.SWEEP_FINISHED, sw.SWEEP_INCOMPLETE}}
_PR_SET_PDEATHSIG = 1


@dataclass
class Launch:
    """How one start of the command ended."""

    returncode: int            # as Popen has it: negative for a signal
    stopped_by: str | None     # the signal the supervisor received and passed on, if any

    @property
    def exit_code(self) -> int:
        """The code the supervisor exits with for it: the child's, 128+s for a signal s."""
        return 128 - self.returncode if self.returncode < 0 else self.returncode

    def how(self) -> str:
        if self.returncode < 0:
            return f"the command was killed by {_signal_name(-self.returncode)}"
        return f"the command exited with code {self.returncode}"


@dataclass
class Opened:
    """A run or sweep a launch opened, and its status now: its manifest's, ABORTED for one
    left RUNNING by a driver that is gone, None where it could not be read."""

    kind: str
    url: str
    status: str | None

    @property
    def final(self) -> bool:
        return self.status in _FINAL[self.kind]

    def describe(self) -> str:
        return f"{self.kind} {self.url} ({self.status or 'status unreadable'})"


def supervise(command: Sequence[str], max_restarts: int = DEFAULT_MAX_RESTARTS,
              backoff_s: float = DEFAULT_BACKOFF_S) -> int:
    """Run `command` until it succeeds or a restart cannot help; returns the exit code."""
    # Blocked for the whole supervision and waited for with sigwaitinfo: a signal or the
    # child's end can land at any moment and is never lost; the child gets the original mask.
    original = signal.pthread_sigmask(signal.SIG_BLOCK, _WAITED)
    try:
        with tempfile.TemporaryDirectory(prefix="unbroken-run-") as scratch:
            restarts = 0
            while True:
                told = os.path.join(scratch, f"launch-{restarts}.jsonl")
                try:
                    launch = _run_once(command, told, original)
                except OSError as e:  # not found, not executable: a restart cannot help
                    _say(f"cannot start {command[0]!r}: {e.strerror or e}")
                    return 127 if isinstance(e, FileNotFoundError) else 126
                if launch.returncode == 0:
                    return 0
                if launch.stopped_by is not None:
                    _say(f"{launch.how()} after {launch.stopped_by} was passed on to it; not restarting")
                    return launch.exit_code
                opened = [_opened(entry) for entry in supervision.recorded(told)]
                target = next((o for o in reversed(opened) if not o.final), None)
                if target is None:
                    _say(f"{launch.how()}; not restarting: {_why_not(opened)}")
                    return launch.exit_code
                if restarts >= max_restarts:
                    _say(f"{launch.how()}; not restarting: {max_restarts} restart"
                         f"{'s' if max_restarts != 1 else ''} reached ({target.describe()})")
                    return launch.exit_code
                restarts += 1
                delay = min(backoff_s * 2 ** min(restarts - 1, 32), MAX_BACKOFF_S)
                _say(f"{launch.how()}; restart {restarts} of {max_restarts} in {delay:g} s, "
                     f"resuming {target.describe()}")
                received = _wait_for_signal(delay)
                if received is not None:
                    _say(f"{received} received while waiting to restart; not restarting")
                    return launch.exit_code
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, original)


def _run_once(command: Sequence[str], told: str, mask: set[signal.Signals]) -> Launch:
    """Start the command once with UNBROKEN_SUPERVISED=`told`, pass SIGTERM/SIGINT on to it,
    and wait for its end (woken by SIGCHLD, never by polling)."""
    env = dict(os.environ)
    env[supervision.ENV] = told
    proc = subprocess.Popen(list(command), env=env, preexec_fn=_child_setup(mask, os.getpid()))
    stopped_by = None
    while True:
        returncode = proc.poll()
        if returncode is not None:
            return Launch(returncode, stopped_by)
        info = signal.sigwaitinfo(_WAITED)
        if info.si_signo in _TERMINAL:
            stopped_by = stopped_by or _signal_name(info.si_signo)
            try:
                os.kill(proc.pid, info.si_signo)
            except ProcessLookupError:
                pass  # it has ended; its SIGCHLD is pending


def _child_setup(mask: set[signal.Signals], parent: int) -> Callable[[], None]:
    """What the child does between fork and exec: a process group of its own, death with the
    supervisor (PDEATHSIG; exit now if the supervisor is already gone) and the signal mask the
    supervisor had before it blocked signals for itself. libc is loaded here, before the fork."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: no PDEATHSIG
        prctl = None

    def setup() -> None:
        os.setpgrp()
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    return setup


def _wait_for_signal(seconds: float) -> str | None:
    """Wait `seconds` before a restart; the name of a SIGTERM/SIGINT that ends the wait early."""
    info = signal.sigtimedwait(_TERMINAL, max(seconds, 0.0))
    return _signal_name(info.si_signo) if info is not None else None


def _opened(entry: dict[str, str]) -> Opened:
    """The run or sweep a launch recorded, with its status as its manifest has it now."""
    kind, url = entry["kind"], entry["url"]
    try:
        storage = Storage.from_url(url)
        status = mf.load(storage).status if kind == supervision.RUN else sw.load(storage).status
        if status == mf.RUNNING and live_holder(storage) is None:
            status = mf.ABORTED  # its driver died before it could record an end (as `ls` says)
    except Exception:  # unreadable here (gone, or storage this process cannot open)
        status = None
    return Opened(kind, url, status)


def _why_not(opened: list[Opened]) -> str:
    if not opened:
        return ("it opened no run or sweep (it failed before opening one: a changed configuration, "
                "bad input or an import error, say; its output says which)")
    return ", ".join(o.describe() for o in opened)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _say(text: str) -> None:
    print(f"{PREFIX} {text}", file=sys.stderr, flush=True)
