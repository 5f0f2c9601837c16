"""In-place recovery, the driver's half (the protocol and the worker's half are in
`unbroken.worker.recovery.peer_state`): once a failure is final, decide whether the next attempt can
start on the ranks that are still alive, from the state of the last complete round that one
of them holds, and tell them to stay.

Possible when the run asks for it (`FailureConfig(recovery="in_place")`), the engine can
start single ranks again (`WorkerGroup.can_rejoin`; on Ray a lost node's rank starts again
in its bundle, which Ray places on another node), and the ranks' TrainState is armed for
just-in-time checkpoints. An elastic run does not wait for a lost node's ranks to be placed
again: it shrinks in place (`InPlacePlan.without`), going on with the ranks whose nodes are
alive, numbered again in order, when they are at least `min_workers` (else they are started
again in their bundles, as in a run of fixed size). The offers are
those of the just-in-time protocol (`worker.recovery.just_in_time`): the lowest rank that offers the
attempt's last complete round is the source; every rank that offered and is alive stays;
the others (dead, told they cannot help, or silent for `OFFER_WAIT_S`, e.g. blocked for
good) are started again; after a rank lost with its node, the wait lasts until the
survivors' collective timeout has released them (`release_at`). When no rank offers that
round, nothing is sent, and the failure goes on to a just-in-time checkpoint and a
restart, as before.

A hang (`hang_timeout_s`) is recovered in place when the hung ranks can be told apart
(`free_hung`): a rank that cannot even write its stacks (a stopped or frozen process) is
killed alone, and the ranks blocked in a collective with it get the error of a dead peer,
offer, and stay, as after any death.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from unbroken.core.config import FailureConfig
from unbroken.errors import WorkerDied, WorkerHangError
from unbroken.execution import hang_stacks
from unbroken.execution.recovery.just_in_time import OFFER_WAIT_S, Coordinator, commit_just_in_time
from unbroken.run.handle import Run
from unbroken.worker.recovery.messages import Stay


@dataclass(frozen=True)
class InPlacePlan:
    """How the next attempt recovers in place."""

    iteration: int              # the round it resumes from
    source: int                 # the rank that sends its state of that round to every rank
    kept: tuple[int, ...]       # the ranks that keep their processes
    replaced: tuple[int, ...]   # the ranks started again in new processes
    # The ranks of the failed attempt (numbered as there) that the next one goes on without: an
    # elastic run's ranks lost with their node. The others are numbered again in order, and
    # `source`, `kept` and `replaced` are their new numbers.
    dropped: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        """How many ranks the attempt recovering in place has."""
        return len(self.kept) + len(self.replaced)

    def record(self) -> dict[str, Any]:
        """What the attempt record keeps of it (Attempt.in_place)."""
        return {"iteration": self.iteration, "source": self.source, "kept": list(self.kept),
                "replaced": list(self.replaced), **({"dropped": list(self.dropped)} if self.dropped else {})}

    def without(self, lost: set[int]) -> InPlacePlan:
        """The plan of an elastic run that goes on without the ranks in `lost` (lost with their
        node; never the source or a kept rank, which offered): the ranks left keep their order."""
        order = [r for r in range(self.size) if r not in lost]
        new = {old: rank for rank, old in enumerate(order)}
        return InPlacePlan(self.iteration, new[self.source], tuple(new[r] for r in self.kept),
                           tuple(new[r] for r in self.replaced if r not in lost), tuple(sorted(lost)))


def allowed(failure_config: FailureConfig, group: Any, retried: bool) -> bool:
    """Whether the failure of an attempt may be recovered in place: the run asks for it, its
    engine can start single ranks again (a lost node's ranks too: on Ray, in their bundles,
    which Ray places on another node), and the failure policy would retry it."""
    return failure_config.recovers("in_place") and getattr(group, "can_rejoin", False) and retried


# How long past the collective timeout a survivor released by it may take to offer.
RELEASE_SLACK_S = 2.0


def release_at(failure_config: FailureConfig, failures: list[tuple[int, BaseException]],
               last_heard: float) -> float | None:
    """When a rank was lost with its node, the latest time (monotonic) its survivors are released
    from a collective with it, where connections to a machine that vanished stay open: their
    collective began before the attempt's last message (`last_heard`) and ends by
    `FailureConfig.collective_timeout_s`. None when nothing was lost with its node or the run
    sets no such timeout."""
    timeout = failure_config.collective_timeout_s
    if timeout is None or not lost_with_node(failures):
        return None
    return last_heard + timeout + RELEASE_SLACK_S


def lost_with_node(failures: list[tuple[int, BaseException]]) -> set[int]:
    """The ranks among an attempt's `failures` that were lost with their node."""
    return {rank for rank, error in failures if isinstance(error, WorkerDied) and error.node_lost}


def shrunk(plan: InPlacePlan | None, failures: list[tuple[int, BaseException]],
           min_workers: int | None) -> InPlacePlan | None:
    """The plan an elastic run (`min_workers` set) goes on with: without the ranks lost with
    their node (`InPlacePlan.without`), when at least `min_workers` ranks are left; otherwise
    the lost ranks start again in their bundles, as in a run of fixed size (`plan` as it is)."""
    lost = lost_with_node(failures) if min_workers is not None else set()
    if plan is None or not lost or plan.size - len(lost) < min_workers:
        return plan
    return plan.without(lost)


def free_hung(run: Run, group: Any, error: WorkerHangError, may_stay: bool, armed: set[int],
              running: set[int], failures: list[tuple[int, BaseException]]) -> None:
    """Attempt `run.attempt` hung (`error`): where it may recover in place (`may_stay`, every
    rank still `running` is `armed`), capture where each rank was (`hang_stacks.capture`) and
    kill, alone, the running ranks that could not write their stacks (named in the attempt
    record, `hang["killed"]`); the hang is then the attempt's first failure (in `failures`)
    and the others fail, offer and stay as after any death. Otherwise raises `error` (the
    attempt ends as before); so too when every running rank wrote its stacks (a wait in
    Python code: which rank is to blame is not known) or none did."""
    at = hang_stacks.capture(run, group, error) if may_stay and running <= armed else {}
    hung = sorted(rank for rank in running if str(rank) in at and at[str(rank)] is None)
    if not hung or len(hung) == len(running):
        raise error
    for rank in hung:
        group.kill(rank)
    run.attempt.hang["killed"] = hung
    failures.append((hung[0], error))


def settle(run: Run, coordinator: Coordinator, group: Any, num_workers: int, may_stay: bool,
           running: Callable[[], set[int]], events: Callable[[float], Iterator[tuple[int, Any]]],
           commit: Callable[[int, list[Any], dict[str, Any]], Any],
           released_by: float | None = None) -> InPlacePlan | None:
    """The failure of `run`'s current attempt is final, and its ranks' TrainState is armed:
    when `may_stay` (the run, its engine and its failure policy allow a recovery in place),
    have the ranks that hold the last complete round stay (`plan`); otherwise, or when none
    does, have one of them save it just in time (`commit_just_in_time`, which `commit`s it,
    in the attempt record). `released_by`: see `plan`. Returns the plan of the recovery in
    place, if there is one."""
    if may_stay:
        row = run.history.last  # the last complete round, if this attempt completed one
        target = row["training_iteration"] if row and row.get("attempt") == run.attempt.number else None
        staying = plan(coordinator, group, target, num_workers, running, events, released_by)
        if staying is not None:
            return staying
    run.attempt.jit_checkpoint = commit_just_in_time(run, coordinator, group, running, events, commit)
    return None


def plan(coordinator: Coordinator, group: Any, target: int | None, num_workers: int,
         running: Callable[[], set[int]], events: Callable[[float], Iterator[tuple[int, Any]]],
         released_by: float | None = None) -> InPlacePlan | None:
    """Wait (at most OFFER_WAIT_S, or until `released_by` (`release_at`) when that is later)
    for the armed ranks still `running` to offer, then choose
    the source for round `target` and send `Stay` to every rank that stays. None, with
    nothing sent, when no live rank offers round `target`. `events(timeout)`: the group's
    next events, each already taken by the controller (offers reach `coordinator`).

    A failed rank that cannot help (told so when it offered) ends its attempt, but its process
    may live on and keep the connections its peers are blocked on (a Ray actor outlives its
    attempt): when no rank has offered round `target` after the wait, such ranks are killed,
    which releases the blocked ones, and the wait begins again once."""
    def offers_after_wait(until: float = 0.0) -> tuple[list[int], list[int]]:
        deadline = max(time.monotonic() + OFFER_WAIT_S, until)
        while running() & coordinator.armed and time.monotonic() < deadline:
            for rank, message in events(min(0.1, max(0.0, deadline - time.monotonic()))):
                if isinstance(message, WorkerDied):
                    coordinator.dead.add(rank)
        gone = coordinator.answered | coordinator.dead
        live = sorted(r for r in coordinator.offers if r not in gone)
        return live, [r for r in live if coordinator.offers[r].iteration == target]

    live, holders = offers_after_wait(released_by or 0.0)
    let_go = coordinator.answered - coordinator.dead
    if target is not None and not holders and running() & coordinator.armed and let_go:
        for rank in let_go:
            group.kill(rank)
        live, holders = offers_after_wait()
    if target is None or not holders:
        return None
    for rank in live:
        coordinator.answered.add(rank)
        group.send(rank, Stay(holders[0], target))
    return InPlacePlan(target, holders[0], tuple(live), tuple(r for r in range(num_workers) if r not in live))
