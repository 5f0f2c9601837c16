"""The sweep driver's running trials: each trial's process (`trial_process`), what it has sent,
and the waiting on all of them at once.

The sweep driver waits, without polling, on the processes' sentinels and pipes and on its
signal pipe (`wait`), then takes what the ready ones sent and the ones that ended (`reap`).
A trial sends where its driver was placed (`TrialPlaced`, handed to `on_placed` as it comes)
and, last, its outcome (`worker.protocol`).

With `TuneConfig(reuse_actors=True)` a trial's process that ends its trial cleanly waits
for another (`trial_process`): its trial has ended, and the process is idle until the next
trial to start takes it (`take_idle`), or the sweep lets it end (`close_idle`). A process
gives its GPUs back (`on_gone`) only when it ends.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from unbroken.execution.preemption import Interrupts
from unbroken.store.sweep_manifest import TrialRecord
from unbroken.worker.protocol import TrialDone, TrialOutcome, TrialPlaced, TrialTaken

log = logging.getLogger("unbroken")

POLL_S = 1.0  # the longest wait: the sweep's lease beats at least this often


@dataclass
class Running:
    """One running trial."""

    record: TrialRecord
    proc: Any  # a LocalTrialProcess or a RayTrialProcess (see trial_process)
    message: TrialOutcome | None = None
    conn_open: bool = True
    share: int = 0  # on a Ray cluster: the workers it may start with (counted until it is sized)
    gpus: list[str] = field(default_factory=list)  # on the local engine: the GPUs it was given
    taken: bool = True  # False until a kept process given the trial says it took it (TrialTaken)


class RunningTrials:
    """The trials whose processes run, by name."""

    def __init__(self, on_placed: Callable[[TrialRecord, TrialPlaced], None],
                 on_gone: Callable[[list[str]], None] = lambda gpus: None) -> None:
        self.on_placed = on_placed
        self.on_gone = on_gone  # a process ended: the GPUs it was given
        self._by_name: dict[str, Running] = {}
        self._idle: list[Running] = []  # processes waiting for another trial (their last trial's Running)

    def __len__(self) -> int:
        return len(self._by_name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def values(self) -> list[Running]:
        return list(self._by_name.values())

    def add(self, running: Running) -> None:
        self._by_name[running.record.name] = running

    def forward(self, signal_name: str | None, sweep: str) -> None:
        """Pass a SIGTERM or SIGINT on to every running trial (their process groups are their
        own, so a Ctrl-C reaches them only this way); each checkpoints and stops."""
        signum = signal.Signals[signal_name or "SIGTERM"]
        log.warning("sweep %s: %s received: forwarded to %d running trial(s), which "
                    "checkpoint and stop; no new trial starts", sweep, signum.name, len(self))
        for r in self.values():
            r.proc.signal(signum)

    def idle(self) -> int:
        """How many processes wait for another trial."""
        return len(self._idle)

    def take_idle(self) -> Running | None:
        """A process waiting for another trial (the `Running` of its last one), now taken."""
        return self._idle.pop() if self._idle else None

    def close_idle(self) -> None:
        """Let the processes waiting for another trial end."""
        while self._idle:
            r = self._idle.pop()
            r.proc.close()
            self.on_gone(r.gpus)

    def kill_all(self) -> None:
        every = self.values() + self._idle
        for r in every:
            r.proc.kill()
        for r in every:
            r.proc.join()

    def wait(self, interrupts: Interrupts) -> list[Any]:
        """Block until a trial process ends, a trial sends, or a signal comes (POLL_S at most);
        returns what is ready."""
        waits: list[Any] = [interrupts, *(r.proc.sentinel for r in self._idle)]
        for r in self.values():
            waits.append(r.proc.sentinel)
            if r.conn_open:
                waits.append(r.proc.conn)
        ready = mp.connection.wait(waits, timeout=POLL_S)
        if interrupts in ready:
            interrupts.drain()
        return ready

    def reap(self, ready: list[Any]) -> list[Running]:
        """Read what the ready trials sent; the trials whose process ended (their last
        messages read), or that ended cleanly in a process that now waits for another trial,
        dropped from the running ones."""
        for r in [r for r in self._idle if r.proc.sentinel in ready]:  # an idle process died
            self._idle.remove(r)
            r.proc.join()
            self.on_gone(r.gpus)
        ended = []
        for name, r in list(self._by_name.items()):
            if r.conn_open and (r.proc.conn in ready or r.proc.sentinel in ready):
                self._read(r)
            if r.proc.sentinel in ready:
                r.proc.join()
                if r.conn_open:
                    self._read(r)
                self.on_gone(r.gpus)
            elif not (r.proc.reusable and isinstance(r.message, TrialDone)):
                continue
            else:
                self._idle.append(r)
            del self._by_name[name]
            ended.append(r)
        return ended

    def _read(self, r: Running) -> None:
        try:
            while r.proc.conn.poll():
                message = r.proc.conn.recv()
                if isinstance(message, TrialPlaced):
                    self.on_placed(r.record, message)
                elif isinstance(message, TrialTaken):
                    r.taken = True
                else:
                    r.message = message
        except (EOFError, OSError):
            r.conn_open = False
            r.proc.conn.close()
