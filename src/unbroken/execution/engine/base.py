"""The interface an engine implements: a group of workers, one per rank, as the controller
drives it.

The controller (`unbroken.execution.controller`) knows nothing of processes, actors or machines. It
asks a `WorkerGroup` to place and start the ranks, hands each rank a payload, and then only
exchanges `unbroken.worker.protocol` messages with them, learns from the group when a rank is lost
and why (`WorkerDied`, an engine-neutral cause), and kills the group. Each rank talks to the
driver through a `Channel`, a two-way link that the engine provides and the worker's
`Session` uses. The local engine (`engine.local`) and the Ray engine (`engine.ray`) are two
implementations; a test's fake group (`tests/fake_group.py`) is another.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from unbroken.errors import WorkerDied
from unbroken.worker.channel import Channel
from unbroken.worker.protocol import WorkerMessage

__all__ = ["Channel", "Placement", "Wakeup", "WorkerGroup", "WorkerGroupFactory"]


@dataclass(frozen=True)
class Placement:
    """Where one rank runs, as the engine placed it. Ranks are ordered by node: the ranks of
    node 0 come first, and `local_rank` counts within a node."""

    rank: int
    node_rank: int
    local_rank: int
    local_world_size: int
    node_id: str        # the engine's name for the machine (a hostname, a Ray node id)
    node_address: str   # where other ranks reach this node (rank 0's is the rendezvous host)
    cpus: int = 1       # the CPU threads the rank may use (torch's intra-op threads)


class Wakeup(Protocol):
    """Something that can cut a `poll` short, e.g. the driver's signal handlers
    (`preemption.Interrupts`): it becomes readable when woken, and `drain()` resets it."""

    def fileno(self) -> int: ...

    def drain(self) -> None: ...


Event = tuple[int, "WorkerMessage | WorkerDied"]


class WorkerGroup(Protocol):
    """The workers of one attempt, addressed by rank (0 .. num_workers-1).

    Lifecycle: `start` once; then any number of `poll`, `send`, `mark_finished` and
    `lost_ranks` calls; then `shutdown` (always, also after `start` raised). Each attempt
    gets a new group from the engine's factory, except a recovery in place: the failed
    attempt's group then serves the next one too, after `rejoin` (in place of `start`).

    Optional, looked up with getattr: `stacks(wait_s) -> {rank: text or None}`, every live
    rank's Python stacks (`worker.stacks.dump` where the rank runs), asked when the hang
    timeout fires, before `shutdown`; None for a rank that did not answer within `wait_s`.
    `interrupt(ranks)`: give up the step of each rank in `ranks`, whose training loop then
    raises `worker.preemption.StepAbandoned` where it is (a rank outside its loop ignores
    it), when a preemption notice's deadline nears; without it, the ranks run until their
    machine goes.
    """

    num_workers: int
    spans_machines: bool
    """Ranks may run on machines other than the driver's: before training, each checks that it
    sees the run directory the driver wrote (storage must be shared by every node)."""

    def start(self, payload: Callable[[Placement], Any]) -> list[Placement]:
        """Place every rank (all or none: a group that cannot place every rank raises, naming
        what is missing, and leaves nothing running), call `payload(placement)` for each to get
        what the rank runs, and start them. Returns the placements, by rank. Raises on any
        failure to start; `shutdown` is still called afterwards."""
        ...

    def poll(self, timeout: float, wake: Wakeup | None = None) -> list[Event]:
        """What happened within `timeout` seconds, as (rank, message) pairs, in each rank's
        own order (no order is promised across ranks). Returns early, possibly with nothing,
        when `wake` is woken. A rank that ended without `Done` -- its process exited or was
        killed, its node was lost -- appears exactly once as (rank, WorkerDied), in a later
        poll than the one that returned its last message, so the caller has handled that
        message first. A rank passed to `mark_finished` never appears as died. Never raises
        for a rank's failure; raises only when the group itself cannot be waited on."""
        ...

    def send(self, rank: int, message: Any) -> None:
        """Deliver `message` to `rank` (its `Channel.recv` returns it), in order. A rank that
        is gone is not an error here: its death is reported by `poll`."""
        ...

    def mark_finished(self, rank: int) -> None:
        """`rank` said `Done`: its exit from now on is expected, not a death. Called once per
        rank."""
        ...

    def warm_up(self) -> None:
        """The attempt is running and a failure would be retried: get ready to start the next
        attempt's ranks fast (a warm template process, spare actors), in the background.
        Called at most once per attempt, after its first complete round; must not slow the
        running ranks' reports. Idempotent; may do nothing."""
        ...

    def lost_ranks(self, wait_s: float) -> list[WorkerDied]:
        """The ranks killed by a signal or lost with their node so far, waiting up to `wait_s`
        for such a loss to show (when one rank reports an error, a peer killed at the same
        moment is the root cause, and its death may take a moment to be seen). May be called
        any number of times; reads only."""
        ...

    def shutdown(self, kill: bool = False, keep_warm: bool = False) -> None:
        """End the group: wait for the ranks to exit (briefly; then kill them), or with `kill`
        kill them at once (a surviving rank may be blocked in a collective with a dead peer).
        `keep_warm`: leave what `warm_up` prepared for the next group of this fit() (which gets
        this group as `warm`); a later plain `shutdown` releases what no group took.
        Idempotent, and safe after a `start` that raised."""
        ...

    can_rejoin: bool
    """The group can start an attempt on the ranks of the failed one that stayed (`rejoin`)."""

    def kill(self, rank: int) -> None:
        """Only where `can_rejoin`: kill rank `rank` at once (SIGKILL, which also ends a
        stopped process); the others run on, and its death is reported by `poll` as any
        death is. Used by in-place recovery (`execution.recovery.in_place`): a hang's frozen ranks, and
        failed ranks whose live process keeps their peers blocked in a collective."""
        ...

    def rejoin(self, payload: Callable[[Placement], Any], replaced: set[int]) -> list[Placement]:
        """Only where `can_rejoin`, on a group whose attempt failed and whose ranks outside
        `replaced` were told to stay (a recovery in place, see `worker.recovery.peer_state`): start the
        next attempt on it. Each rank that stayed gets `payload(placement)` as a `Rejoin`
        message over its channel; each rank in `replaced` is killed if it still runs, and
        started again in a new process. Returns the placements, by rank (those of `start`).
        The group then serves the new attempt as after `start`."""
        ...

    def drop(self, ranks: set[int]) -> None:
        """Only on an engine whose ranks can be lost with their node (Ray; the local engine's
        cannot), before `rejoin`: the next attempt goes on without `ranks` (an elastic run's
        ranks lost with their node, see `execution.recovery.in_place`). Each is killed if
        it still runs and forgotten; the others are numbered again in order (`renumbered`), and
        `num_workers` counts them. What the group reserved for the dropped ranks stays its own
        (`idle_slots`) until `shutdown`."""
        ...

    def idle_slots(self) -> int:
        """Worker slots the group holds that no rank uses and that a larger attempt could use
        now: on Ray, bundles of dropped ranks that Ray placed again on a live node. An elastic
        run counts them when it looks for room to grow."""
        ...

    def release_placement(self) -> None:
        """On a group shut down with `keep_warm`: give back the resources reserved for its
        ranks, and keep only what it warmed up. The next group then places its ranks anew
        (the run changes size, or the group lost a node and what it reserved there is gone)
        and starts those that land where something was kept warm from it. Idempotent; may
        do nothing (an engine that reserves nothing)."""
        ...


def renumbered(placements: list[Placement], order: list[int]) -> list[Placement]:
    """The placements of the ranks in `order` (old ranks, in their new order), numbered again
    from 0: node ranks in order of first appearance, local ranks counted within a node."""
    nodes: dict[str, list[int]] = {}
    for rank, old in enumerate(order):
        nodes.setdefault(placements[old].node_id, []).append(rank)
    node_rank = {node: i for i, node in enumerate(nodes)}
    return [dataclasses.replace(placements[old], rank=rank, node_rank=node_rank[placements[old].node_id],
                                local_rank=nodes[placements[old].node_id].index(rank),
                                local_world_size=len(nodes[placements[old].node_id]))
            for rank, old in enumerate(order)]


WorkerGroupFactory = Callable[..., WorkerGroup]
"""`factory(scaling, warm=None)`: a new group per attempt. `warm`: the failed group of the
previous attempt, which was asked to `warm_up` and shut down with `keep_warm`; the new group
may start its ranks from what that prepared (and takes it over)."""


def send_each(group: WorkerGroup, ranks: Iterable[int], message: Any) -> None:
    """Send `message` to each of `ranks`, in rank order; one that ended meanwhile is skipped
    (its `Done` or its death is on the way)."""
    for rank in sorted(ranks):
        try:
            group.send(rank, message)
        except OSError:
            pass
