"""A fake worker group: scripted ranks in the test's own process, for driving the controller
through failures, hangs, preemption and mismatched reports in milliseconds.

It keeps the `engine.base.WorkerGroup` contract the way a real engine does: a rank sends
report N+1 only after it took the reply to report N (reports are pipelined), ends with
`Done` once it has the reply to its last report (or was told to stop), and a rank that dies
shows up as `WorkerDied` in a poll after the one with its last message. Real engines run
next to it in the other tests.
"""

from __future__ import annotations

import os
import select
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from unbroken.errors import WorkerDied
from unbroken.execution.engine.base import Placement
from unbroken.worker.protocol import Done, Failed, Reply, Report


def report(checkpoint: bool = False, **metrics: Any) -> tuple:
    """The rank reports `metrics` (an empty checkpoint attached when `checkpoint`)."""
    return ("report", metrics, checkpoint)


def raise_(message: str) -> tuple:
    """The rank's loop raises RuntimeError(message)."""
    return ("raise", message)


def die(signal_name: str = "SIGKILL") -> tuple:
    """The rank's process is killed."""
    return ("die", signal_name)


def lose_node() -> tuple:
    """The rank's node is lost (the engine says so: WorkerDied.node_lost)."""
    return ("die", None)


def call(fn: Any) -> tuple:
    """The test's `fn()` runs at this point of the rank's script (e.g. capacity comes back)."""
    return ("call", fn)


HANG = ("hang",)            # the rank never sends anything again
SLOW = ("slow",)            # the rank sends nothing more in this poll (a slower peer)
SIGTERM_DRIVER = ("sigterm",)  # the driver gets a SIGTERM (a preemption notice)


@dataclass
class FakeRank:
    script: list[tuple]
    inbox: list[Any] = field(default_factory=list)
    reports: int = 0
    awaiting_reply: bool = False
    ended: bool = False
    dying: str | None = None  # its death shows in the next poll
    lost: bool = False  # it died with its node
    replies: list[Reply] = field(default_factory=list)

    def _take_reply(self) -> bool:
        """Take the reply to the last report (as Session does before the next report and at
        the end); False while it has not come."""
        if self.awaiting_reply:
            if not self.inbox:
                return False
            reply = self.inbox.pop(0)
            self.replies.append(reply)
            self.awaiting_reply = False
            if reply.stop:
                self.script = []  # StopTraining at the next report: the loop ends
        return True

    def step(self, iteration: int) -> list[Any]:
        """Everything this rank sends until it blocks (waiting for a reply), pauses, hangs or
        ends. `iteration` is the last one it reported."""
        out: list[Any] = []
        while not self.ended:
            if (not self.script or self.script[0][0] == "report") and not self._take_reply():
                return out
            if not self.script:
                self.ended = True
                out.append(Done(self.reports))
                return out
            kind, *args = self.script.pop(0)
            if kind == "report":
                metrics, checkpoint = args
                iteration += 1
                self.reports += 1
                self.awaiting_reply = True
                out.append(Report(iteration, metrics, [] if checkpoint else None))
            elif kind == "raise":
                self.ended = True
                out.append(Failed(f"Traceback (most recent call last):\nRuntimeError: {args[0]}\n",
                                  cloudpickle.dumps(RuntimeError(args[0])), time.time()))
            elif kind == "die":
                self.ended, self.dying, self.lost = True, args[0] or "SIGKILL", args[0] is None
            elif kind == "hang":
                self.ended = True
            elif kind == "slow":
                return out  # nothing more in this poll
            elif kind == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            elif kind == "call":
                args[0]()
        return out


class FakeWorkerGroup:
    """`num_workers` scripted ranks; `scripts[rank]` is what rank does, step by step."""

    spans_machines = False
    can_rejoin = False

    def warm_up(self) -> None:
        self.warmed = True

    def __init__(self, scripts: list[list[tuple]]) -> None:
        self.warmed = False
        self.released = False
        self.num_workers = len(scripts)
        self.ranks = [FakeRank(list(s)) for s in scripts]
        self.payloads: list[Any] = []
        self.finished: set[int] = set()
        self.killed: list[WorkerDied] = []
        self.shut_down: bool | None = None  # the `kill` of shutdown, once called

    def start(self, payload: Any) -> list[Placement]:
        placements = [Placement(r, 0, r, self.num_workers, "fake-node", "127.0.0.1")
                      for r in range(self.num_workers)]
        self.payloads = [payload(p) for p in placements]
        return placements

    def poll(self, timeout: float, wake: Any = None) -> list[tuple[int, Any]]:
        events: list[tuple[int, Any]] = []
        for rank, fake in enumerate(self.ranks):
            if fake.dying is not None:
                died = (WorkerDied(rank, node_lost="fake node lost", engine="fake") if fake.lost
                        else WorkerDied(rank, signal_name=fake.dying, engine="fake"))
                self.killed.append(died)
                fake.dying = None
                events.append((rank, died))
                continue
            last = self.payloads[rank].info.start_iteration + fake.reports
            events.extend((rank, m) for m in fake.step(last))
        if not events and wake is not None:
            # Nothing more comes from the scripted ranks: wait, as a real poll does, for the
            # only event left (a signal waking the driver) or the timeout.
            if select.select([wake], [], [], timeout)[0]:
                wake.drain()
        return events

    def send(self, rank: int, message: Any) -> None:
        if isinstance(message, Reply):
            self.ranks[rank].inbox.append(message)

    def mark_finished(self, rank: int) -> None:
        assert rank not in self.finished, "mark_finished is called once per rank"
        self.finished.add(rank)

    def lost_ranks(self, wait_s: float) -> list[WorkerDied]:
        """The killed ranks, also those whose death poll has not reported yet (a real engine
        waits up to `wait_s` for the process's exit to show)."""
        dying = [WorkerDied(r, signal_name=f.dying, engine="fake")
                 for r, f in enumerate(self.ranks) if f.dying is not None]
        return sorted(self.killed + dying, key=lambda d: d.rank)

    def release_placement(self) -> None:
        self.released = True

    def idle_slots(self) -> int:
        return 0

    def shutdown(self, kill: bool = False, keep_warm: bool = False) -> None:
        self.shut_down = kill
        self.kept_warm = keep_warm
