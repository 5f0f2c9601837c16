"""Recovery, the driver's half: from a failed attempt to the next one (the worker's half is
`unbroken.worker.recovery`, the messages `unbroken.worker.recovery.messages`).

Once an attempt's failure is final (no incomplete round and no pending commit can complete
any more: see `AttemptLoop.drive`):
1. just in time, where every rank's TrainState is armed: the survivors stay for a recovery in
   place (`in_place`), or else one of them saves the last complete round (`just_in_time`);
2. `decide` asks the failure policy (`failure_policy`), handed in, whether to go on, and says
   how: in place, in place without the ranks lost with their node (an elastic run shrinks),
   a restart of the whole group from the latest committed checkpoint, or give up;
3. `hand_back` disposes of the failed group: its ranks stay for the next attempt (in
   place), or it is shut down, keeping what it warmed up for a restart (`WorkerGroup.warm_up`,
   asked for once an attempt has run `WARM_UP_AFTER_S`), and an elastic run learns which
   of its nodes were lost.
"""

from __future__ import annotations

import enum
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from unbroken.core.config import FailureConfig
from unbroken.errors import StorageError, WorkerDied, WorkerHangError
from unbroken.execution import hang_stacks
from unbroken.execution.elastic import ElasticScaler
from unbroken.execution.engine.base import Placement, WorkerGroup
from unbroken.execution.recovery import in_place
from unbroken.execution.recovery.failure_policy import FailureDecision, FailurePolicy
from unbroken.execution.recovery.in_place import InPlacePlan
from unbroken.execution.recovery.just_in_time import Coordinator
from unbroken.run.handle import Run

log = logging.getLogger("unbroken")

# How long an attempt runs before its group warms up for a restart (`WorkerGroup.warm_up`):
# the start of an attempt keeps the machines to itself, and a failure before then restarts
# cold, as it would without warm restarts.
WARM_UP_AFTER_S = float(os.environ.get("UNBROKEN_WARM_UP_AFTER_S", "10"))

Failures = list[tuple[int, BaseException]]  # (rank, its error or WorkerDied), in order
Events = Callable[[float], Iterator[tuple[int, Any]]]  # the group's next events, each taken already
Commit = Callable[[int, list[Any], dict[str, Any]], Any]  # (iteration, per-rank files, row) -> marker


class Next(enum.Enum):
    """What follows a failed attempt (`Recovery.decide`)."""

    IN_PLACE = "recovering in place"  # the ranks that stayed go on; the others start again
    SHRINK = "recovering in place without the ranks lost with their node"  # an elastic run
    RESTART = "restarting the workers from the latest committed checkpoint"
    GIVE_UP = "giving up"


def record_safely(run: Run, step: Callable[..., Any], *args: Any) -> None:
    """Write to the run directory on the way out of a failure, unless storage itself is what
    failed (then the next attempt marks it)."""
    try:
        step(*args)
    except StorageError as e:
        log.error("run %s: could not record the failure (%s); the next attempt marks it", run.path, e)


class Recovery:
    """One fit()'s recovery: the failure policy, the group kept warm, the ranks that stay."""

    def __init__(self, run: Run, config: FailureConfig, policy: FailurePolicy,
                 elastic: ElasticScaler | None) -> None:
        self.run, self.config, self.policy, self.elastic = run, config, policy, elastic
        self.jit = Coordinator()  # the attempt's just-in-time offers and saver
        self.warm: WorkerGroup | None = None  # a failed group that warmed up: the next starts from it
        self.plan: InPlacePlan | None = None  # the failing attempt's ranks stay (see in_place)
        self._rejoin: tuple[WorkerGroup, InPlacePlan] | None = None  # ... for the next attempt
        self._cold = True  # the attempt's group has not been asked to warm up yet
        self._started = 0.0  # when the attempt's ranks were started

    def staying(self) -> tuple[WorkerGroup, InPlacePlan] | None:
        """At an attempt's beginning: the group whose ranks stayed, with its plan, if any."""
        rejoin, self._rejoin, self.plan = self._rejoin, None, None
        return rejoin

    def starting(self) -> None:
        """The attempt's ranks are about to start: nothing of its group is warm yet."""
        self._cold, self.jit = True, Coordinator()

    def started(self) -> None:
        """The attempt's ranks were started just now (the warm-up is timed from here)."""
        self._started = time.monotonic()

    def warm_up_when_due(self, group: WorkerGroup) -> None:
        """Once the attempt has run WARM_UP_AFTER_S (at its first round when it follows a failure:
        the run fails often) and a failure would be retried, have the group get a restart ready
        in the background (the ranks are in their loop by now)."""
        due = 0.0 if getattr(self.policy, "failures", 0) else WARM_UP_AFTER_S
        if self._cold and time.monotonic() - self._started >= due and self.policy.can_retry():
            self._cold = False
            group.warm_up()

    def armed(self, num_workers: int) -> None:
        """A rank said its TrainState is armed: once every rank has, record their step seeds
        in the run (`RunManifest.step_seeds`), where they changed, for the later attempts (a
        rank started again draws as the one it replaces)."""
        seeds = [self.jit.seeds.get(rank) for rank in range(num_workers)]
        if None not in seeds and seeds != self.run.manifest.step_seeds:
            self.run.manifest.step_seeds = seeds
            self.run.save_manifest()

    def may_stay(self, group: WorkerGroup) -> bool:
        return in_place.allowed(self.config, group, self.policy.can_retry())

    def hung(self, group: WorkerGroup, error: WorkerHangError, running: set[int], failures: Failures) -> None:
        """No rank reported for `hang_timeout_s`: free the hung ranks where the others may stay
        (`in_place.free_hung`); raises `error` otherwise."""
        in_place.free_hung(self.run, group, error, self.may_stay(group), self.jit.armed, running, failures)

    def save_just_in_time(self, group: WorkerGroup, num_workers: int, failures: Failures, last_heard: float,
                          running: Callable[[], set[int]], events: Events, commit: Commit,
                          stay: bool = True) -> None:
        """The failure is final: when the ranks' TrainState can (`jit_checkpoint`), have the
        survivors stay for a recovery in place (unless not `stay`: a preempted machine's ranks
        go), or else a surviving rank save the last complete round and `commit` it, and say in
        the attempt record what happened."""
        if not self.jit.armed or self.jit.closed:
            return
        released = in_place.release_at(self.config, failures, last_heard)
        plan = in_place.settle(self.run, self.jit, group, num_workers, stay and self.may_stay(group), running,
                               events, commit, released)
        min_workers = self.elastic.sizing.min_workers if self.elastic is not None else None
        self.plan = in_place.shrunk(plan, failures, min_workers)

    def hand_back(self, group: WorkerGroup, error: BaseException, failures: Failures,
                  placements: list[Placement], preempted: bool = False) -> None:
        """The attempt on `group` failed with `error`: keep its ranks for a recovery in place,
        or shut it down (keeping what it warmed up, unless `preempted`: spares may sit on a
        node that goes); tell an elastic run which nodes it lost."""
        if self.plan is not None:
            self._rejoin = (group, self.plan)
        else:
            if isinstance(error, WorkerHangError):  # where each rank was, before teardown
                record_safely(self.run, hang_stacks.capture, self.run, group, error)
            if preempted:
                self._cold = True
            self._shut_down(group, failures)
        if self.elastic is not None:
            self.elastic.failed([(placements[r].node_id, bool(e.node_lost))
                                 for r, e in failures if isinstance(e, WorkerDied)])

    def _shut_down(self, group: WorkerGroup, failures: Failures) -> None:
        """Kill a failed attempt's group; when it warmed up for a restart, keep what it prepared
        for the next group (replacing an older group kept warm), and after a lost node only
        that: the next group is placed anew."""
        group.shutdown(kill=True, keep_warm=not self._cold)
        if not self._cold:
            if self.warm is not None:
                self.warm.shutdown(kill=True)
            self.warm = group
            if in_place.lost_with_node(failures):
                group.release_placement()  # what it held on the lost node is gone; spares elsewhere stay

    def decide(self, error: BaseException) -> Next:
        """What follows the failure `error` of an attempt, as the failure policy decides; a
        recovery in place counts as a failure too."""
        if not isinstance(error, Exception) or self.policy.decide(error) is not FailureDecision.RETRY:
            return Next.GIVE_UP
        if self._rejoin is None:
            return Next.RESTART
        return Next.SHRINK if self._rejoin[1].dropped else Next.IN_PLACE

    def close(self) -> None:
        """fit() ends: what a failed group kept warm, and ranks that stayed for an attempt that
        never began, are shut down."""
        if self.warm is not None:
            self.warm.shutdown(kill=True)
        if self._rejoin is not None:
            self._rejoin[0].shutdown(kill=True)
