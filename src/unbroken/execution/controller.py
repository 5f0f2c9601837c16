"""The controller: drives one run through its attempts.

It starts a worker group, turns each round of reports into one metric row (and, when
ranks attached files, one committed checkpoint), and on a worker failure asks the
failure policy whether to restart the group from the latest committed checkpoint.
The worker group is the engine's business; storage is the Run's.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from unbroken.core import faults
from unbroken.core.config import RunConfig, ScalingConfig, stop_due_at
from unbroken.errors import (
    InsufficientResourcesError,
    LeaseLostError,
    StorageError,
    TrainingInterruptedError,
    WorkerDied,
    WorkerHangError,
)
from unbroken.execution import controller_state as states
from unbroken.execution import hang_stacks, in_place
from unbroken.execution.collective_calls import CollectiveCalls
from unbroken.execution.elastic import CapacityProbe, ElasticScaler, Unbounded
from unbroken.execution.engine.base import Placement, WorkerGroup, WorkerGroupFactory, send_each
from unbroken.execution.failure_policy import FailureDecision, FailurePolicy
from unbroken.execution.in_place import InPlacePlan
from unbroken.execution.jit_coordinator import Coordinator
from unbroken.execution.preemption import Interrupts
from unbroken.execution.rank_payload import rank_payload
from unbroken.execution.report_pipeline import ReportPipeline, Round
from unbroken.execution.report_rounds import ReportRounds
from unbroken.execution.validations import ValidationRunner, Validations
from unbroken.execution.worker_failures import first_line, give_up_error, record, root_cause, worker_exception
from unbroken.run.handle import Run
from unbroken.store import manifest as mf
from unbroken.store.commit import Marker
from unbroken.worker.protocol import (
    JIT_MESSAGES,
    Done,
    Failed,
    Gather,
    Rendezvous,
    Reply,
    Report,
    Staged,
    Validated,
)
from unbroken.worker.runner import PROBE

log = logging.getLogger("unbroken")

POLL_S = 1.0
# How long a failed group's incomplete round may take to complete (the other ranks are
# finishing the step the failed rank already reported; see `rounds`).
ROUND_GRACE_S = 10.0
VALIDATION_POLL_S = 0.1  # how often a validation in flight is looked at (polled, not in the group's wait)
# How long an attempt runs before its group warms up for a restart (`WorkerGroup.warm_up`):
# the start of an attempt keeps the machines to itself, and a failure before then restarts
# cold, as it would without warm restarts.
WARM_UP_AFTER_S = float(os.environ.get("UNBROKEN_WARM_UP_AFTER_S", "10"))


class _StopNow(BaseException):
    """A second signal: stop the workers without waiting for anything."""


class Controller:
    """Runs `trainer.training_loop()` on a worker group until the run finishes or gives up.

    `group_factory` makes each attempt's worker group (the engine's `make_worker_group`, a fake
    in tests); `failure_policy` decides which failures are retried (default: from run_config)."""

    def __init__(self, trainer: Any, run: Run, restore_hint: str, group_factory: WorkerGroupFactory,
                 failure_policy: FailurePolicy | None = None,
                 validation_runner: ValidationRunner | None = None,
                 capacity: CapacityProbe | None = None) -> None:
        self.trainer = trainer
        self.group_factory = group_factory  # scaling -> a new WorkerGroup for each attempt
        self.run = run
        self.scaling: ScalingConfig = trainer.scaling_config
        self.run_config: RunConfig = trainer.run_config
        self.restore_hint = restore_hint
        # Changed only by `_transition`; Starting: the attempt about to begin, as `begin_attempt` numbers it.
        self._state: states.ControllerState = states.Starting(run.manifest.attempt_count + 1)
        self.policy = (FailurePolicy(self.run_config.failure_config) if failure_policy is None
                       else failure_policy)
        self.interrupts = Interrupts()
        # Workers get the trainer without the driver-side callbacks (never called there, and
        # a callback may hold something that cannot travel to a forkserver worker).
        self._worker_trainer = copy.copy(trainer)
        self._worker_trainer.run_config = dataclasses.replace(trainer.run_config, callbacks=None)
        validation = getattr(trainer, "validation_config", None)
        self._worker_trainer.validation_config = None  # a validation runs in the driver's validations only
        self._validations = Validations(run, validation, validation_runner)
        self._cold = True  # the attempt's group has not been asked to warm up for a restart yet
        self._started = 0.0  # when the attempt's ranks were started
        self._warm: WorkerGroup | None = None  # a failed group that warmed up: the next starts from it
        self._reports = ReportPipeline(run, self.run_config)  # rows, commits, replies
        # An elastic run (num_workers=(min, max)): each attempt's size, from the engine's `capacity`.
        self._elastic = (ElasticScaler(self.scaling, capacity or Unbounded(),
                                       start_limit=getattr(trainer, "_elastic_start_limit", None))
                         if self.scaling.elasticity_enabled else None)
        self._in_place: InPlacePlan | None = None  # the failing attempt's ranks stay (see in_place)
        self._rejoin: tuple[WorkerGroup, InPlacePlan] | None = None  # ... for the next attempt
        self._placements: list[Placement] = []  # the attempt's ranks, by rank
        self._failures: list[tuple[int, BaseException]] = []  # the attempt's failures, by rank

    @property
    def state(self) -> states.ControllerState:
        """The controller's current state (read-only: see `controller_state`)."""
        return self._state

    def _transition(self, new: states.ControllerState) -> None:
        """Move to state `new`: the one place the state changes (IllegalTransitionError if it may not)."""
        states.check_transition(self._state, new)
        if new != self._state:
            log.debug("run %s: controller %r -> %r", self.run.path, self._state, new)
        self._state = new

    def execute(self) -> None:
        """Run attempts until one finishes; raise TrainingFailedError when the policy gives up
        and TrainingInterruptedError on SIGTERM/SIGINT."""
        with self.interrupts:
            try:
                while True:
                    if self.interrupts.count:
                        self._interrupted()
                    if self._attempt():
                        return
            finally:
                self._validations.close()  # one still in flight runs again under the next driver
                if self._warm is not None:
                    self._warm.shutdown(kill=True)  # what it kept warm, unless a later group took it
                if self._rejoin is not None:
                    self._rejoin[0].shutdown(kill=True)  # ranks that stayed for an attempt not begun
                self._record(self.run.lease.release)  # also when an attempt could not even begin

    def _attempt(self) -> bool:
        """One attempt: True when the run finished, False when the workers should restart."""
        self._transition(states.Starting(self.run.manifest.attempt_count + 1))
        self._placements, self._failures, self._in_place = [], [], None
        rejoin, self._rejoin = self._rejoin, None
        peer = rejoin[1] if rejoin is not None else None
        elastic = self._size_attempt(peer) if self._elastic is not None else None
        resume = self.run.begin_attempt(self.scaling.num_workers, elastic, peer.record() if peer else None)
        attempt = self.run.attempt.number
        if peer is not None:
            log.info("run %s: attempt %d recovers in place from round %d (rank %d sends its state; ranks %s "
                     "start again)", self.run.path, attempt, peer.iteration, peer.source, list(peer.replaced))
        elif resume is not None:
            log.info("run %s: attempt %d resumes from %s", self.run.path, attempt, resume.name)
        group = None
        try:
            group = rejoin[0] if rejoin is not None else self.group_factory(self.scaling, warm=self._warm)
            self._start(group, resume, attempt, peer)
            self._drive(group)
        except BaseException as error:
            if group is not None and self._in_place is not None:
                self._rejoin = (group, self._in_place)  # its ranks stay for the next attempt
            elif group is not None:
                if isinstance(error, WorkerHangError):  # where each rank was, before teardown
                    self._record(hang_stacks.capture, self.run, group, error)
                self._shut_down_failed(group)
            if self._elastic is not None:
                self._elastic.failed([(self._placements[r].node_id, bool(e.node_lost))
                                      for r, e in self._failures if isinstance(e, WorkerDied)])
            if isinstance(error, LeaseLostError):
                raise  # the run belongs to another driver now: write nothing more to it
            if self._gives_up(error, attempt):
                if not isinstance(error, Exception):
                    raise
                raise give_up_error(error,
                    f"training failed in attempt {attempt} of run {self.run.path!r}: {first_line(error)}\n"
                    f"The run and its checkpoints are kept. After fixing the cause, continue it with "
                    f"{self.restore_hint}") from error
            return False
        group.shutdown()
        if isinstance(self.state, states.Stopping) and self.state.stopped:
            if self.state.resize_to is None:
                self._interrupted()
            self.run.end_attempt(mf.RESIZED)
            faults.point("after_resize_stop")  # crash tests: between the two attempts of a resize
            self._transition(states.Resizing(attempt, self.state.resize_to))
            return False
        self._validations.wait_all()  # the Result shows every checkpoint's validation ended
        self.run.end_attempt(mf.FINISHED)
        self.run.finish(mf.FINISHED)
        self._transition(states.Finished())
        return True

    def _size_attempt(self, peer: InPlacePlan | None) -> dict[str, Any]:
        """An elastic run: size this attempt (`ElasticScaler.size`). Returns the attempt's
        record; ends the run as ERRORED when too few workers can be placed in time."""
        try:
            self.scaling, record = self._elastic.size(self._warm, peer.size if peer is not None else None)
        except InsufficientResourcesError as error:
            self._transition(states.Errored(error))
            self._record(self.run.finish, mf.ERRORED)
            raise give_up_error(error, f"run {self.run.path!r} stopped: {first_line(error)}\n"
                                f"The run and its checkpoints are kept; continue it with {self.restore_hint}"
                                ) from error
        log.info("run %s: %d workers (%s; %d placeable, at most %d)", self.run.path, self.scaling.num_workers,
                 record["reason"], record["capacity"], self._elastic.sizing.max_workers)
        return record

    def _start(self, group: WorkerGroup, resume: Marker | None, attempt: int,
               peer: InPlacePlan | None = None) -> None:
        """Start the ranks of attempt `attempt` on `group`, resuming from `resume` if given, or
        from a peer's state on the ranks that stayed (`peer`: a recovery in place)."""
        self._cold = True
        probe = self.run.write_probe(PROBE) if group.spans_machines else None
        payload = functools.partial(
            rank_payload, self.run, self._worker_trainer, self.scaling, self._validations.config is not None,
            resume, probe, (peer.source, peer.iteration) if peer is not None else None)
        if peer is not None and peer.dropped:
            group.drop(set(peer.dropped))
        self._placements = (group.rejoin(payload, set(peer.replaced)) if peer is not None
                            else group.start(payload))
        self._started = time.monotonic()
        self._transition(states.Running(attempt))

    def _shut_down_failed(self, group: WorkerGroup) -> None:
        """Kill a failed attempt's group; when it warmed up for a restart, keep what it prepared
        for the next group (replacing an older group kept warm), and after a lost node only
        that: the next group is placed anew."""
        group.shutdown(kill=True, keep_warm=not self._cold)
        if not self._cold:
            if self._warm is not None:
                self._warm.shutdown(kill=True)
            self._warm = group
            if in_place.lost_with_node(self._failures):
                group.release_placement()  # what it held on the lost node is gone; spares elsewhere stay

    def _gives_up(self, error: BaseException, attempt: int) -> bool:
        """Close failed attempt `attempt`; ask the failure policy: False to restart, True (run closed)
        to raise `error`. Raises TrainingInterruptedError when a second signal stopped the workers."""
        if isinstance(self.state, states.Interrupted):
            self._interrupted()
        self._record(self.run.end_attempt, mf.ERRORED, error)
        if isinstance(error, Exception) and self.policy.decide(error) is FailureDecision.RETRY:
            self._transition(states.Restarting(attempt, error))
            log.warning("run %s: attempt %d failed (%s); restarting the workers from the latest "
                        "committed checkpoint (failure %d of %s)", self.run.path, attempt,
                        first_line(error), self.policy.failures,
                        self.run_config.failure_config.max_failures)
            return False
        self._transition(states.Errored(error))
        self._record(self.run.finish, mf.ERRORED if isinstance(error, Exception) else mf.INTERRUPTED)
        return True

    def _record(self, step: Callable[..., None], *args: Any) -> None:
        """Write to the run directory on the way out, unless storage itself is what failed."""
        try:
            step(*args)
        except StorageError as e:
            log.error("run %s: could not record the failure (%s); the next attempt marks it",
                      self.run.path, e)

    def _interrupted(self) -> None:
        """Close the attempt and the run as INTERRUPTED and raise with the restore hint."""
        if not isinstance(self.state, states.Interrupted):  # a second signal made it so already
            self._transition(states.Interrupted(self.interrupts.signal_name))
        if self.run.attempt is not None and self.run.attempt.ended_at is None:
            self.run.end_attempt(mf.INTERRUPTED)
        self.run.finish(mf.INTERRUPTED)
        latest = self.run.checkpoints.latest
        where = (f"its latest committed checkpoint is {latest.name} (iteration {latest.iteration})"
                 if latest else "it has no committed checkpoint yet")
        raise TrainingInterruptedError(
            f"run {self.run.path!r} was interrupted by {self.interrupts.signal_name}; {where}.\n"
            f"Continue it with {self.restore_hint}") from None

    def _save_just_in_time(self, group: WorkerGroup, rounds: ReportRounds,
                           failures: list[tuple[int, BaseException]]) -> None:
        """The failure is final: when the ranks' TrainState can (`jit_checkpoint`), have the
        survivors stay for a recovery in place (`in_place`), or else a surviving rank save the
        last complete round, commit it as that round's checkpoint, and say in the attempt
        record what happened."""
        if not self._jit.armed or self._jit.closed:
            return

        def events(timeout: float) -> Iterator[tuple[int, Any]]:
            for rank, message in group.poll(timeout):
                self._take(group, rounds, failures, rank, message)
                yield rank, message

        released = in_place.release_at(self.run_config.failure_config, failures, rounds.last_heard)
        plan = in_place.settle(self.run, self._jit, group, rounds.num_workers, self._may_stay(group),
                               lambda: rounds.running, events, released)
        min_workers = self._elastic.sizing.min_workers if self._elastic is not None else None
        self._in_place = in_place.shrunk(plan, failures, min_workers)

    def _may_stay(self, group: WorkerGroup) -> bool:
        return in_place.allowed(self.run_config.failure_config, group, self.policy.can_retry())

    def _drive(self, group: WorkerGroup) -> None:
        """Process worker messages until every worker is done; raise on any failure.

        A failure is raised only once no incomplete round can complete any more (see
        `report_rounds`) and no asynchronous save can commit any more (see `async_save`), so a
        round that every rank reported is recorded and committed first.
        Leaves the state STOPPING when the workers stopped for a preemption, and
        INTERRUPTED (with the workers still running) on a second signal.
        """
        rounds = ReportRounds(self.scaling.num_workers, last_heard=time.monotonic())
        self._reports.start_attempt()
        self._jit = Coordinator()
        self._collectives = CollectiveCalls(self.scaling.num_workers)
        failures: list[tuple[int, BaseException]] = []  # (rank, its error or WorkerDied), in order
        self._failures = failures
        failed_at = 0.0
        signals = 0
        hang_s = self.run_config.failure_config.hang_timeout_s
        try:
            while not rounds.all_done:
                self.run.lease.beat()
                signals = self._take_signals(signals)
                if self._elastic is not None and isinstance(self.state, states.Running) and not failures:
                    self._grow_when_possible(group)
                now = time.monotonic()
                timeout = POLL_S
                if failures:
                    can_complete = rounds.can_complete() or self._reports.can_complete(rounds.failed)
                    if not can_complete or now - failed_at >= ROUND_GRACE_S:
                        self._save_just_in_time(group, rounds, failures)
                        raise root_cause(group, failures)
                    timeout = min(timeout, failed_at + ROUND_GRACE_S - now)
                if hang_s is not None:
                    timeout = max(0.0, min(timeout, rounds.hang_left(now, hang_s)))
                for name in self._validations.poll():
                    send_each(group, rounds.running, Validated(name))
                if self._validations.busy:
                    timeout = min(timeout, VALIDATION_POLL_S)
                events = group.poll(timeout, wake=self.interrupts)
                now = time.monotonic()
                if events:
                    rounds.heard(now)
                elif hang_s is not None and rounds.hang_left(now, hang_s) <= 0 and not failures:
                    in_place.free_hung(self.run, group, rounds.hang_error(hang_s),
                                       self._may_stay(group), self._jit.armed, rounds.running, failures)
                for rank, message in events:
                    self._take(group, rounds, failures, rank, message)
                if failures:
                    failed_at = failed_at or now
                else:
                    rounds.check_counts()
        finally:
            self._reports.close()  # the rounds behind a save that never committed

    def _grow_when_possible(self, group: WorkerGroup) -> None:
        """An elastic run below max_workers: when a check is due and more workers can be placed,
        ask for a checkpoint at the next report and a stop after it (then a larger attempt)."""
        target = self._elastic.grow_to(group.idle_slots)
        if target is not None:
            self._transition(states.Stopping(self.run.attempt.number, None, resize_to=target))
            log.info("run %s: %d workers can be placed now; resizing from %d at the next report's "
                     "checkpoint", self.run.path, target, self.scaling.num_workers)

    def _take_signals(self, seen: int) -> int:
        """React to SIGTERM/SIGINT received since `seen` of them: the first asks for a
        checkpoint and a stop (STOPPING), another one stops at once. Returns the count."""
        count = self.interrupts.count  # once: another signal may land while this one is logged
        if count <= seen:
            return seen
        if count > 1 or (isinstance(self.state, states.Stopping) and self.state.signal is not None):
            log.warning("run %s: %s again: stopping the workers now", self.run.path,
                        self.interrupts.signal_name)
            self._transition(states.Interrupted(self.interrupts.signal_name))
            raise _StopNow
        self._transition(states.Stopping(self.run.attempt.number, self.interrupts.signal_name))
        log.warning("run %s: %s received: the workers checkpoint at their next report, then stop "
                    "(send it again to stop at once)", self.run.path, self.interrupts.signal_name)
        return count

    def _take(self, group: WorkerGroup, rounds: ReportRounds, failures: list[tuple[int, BaseException]],
              rank: int, message: Any) -> None:
        """Handle one event from the group; a failure is collected in `failures`, not raised."""
        if isinstance(message, (Report, Staged)):
            done = self._reports.take(group, rounds, rank, message,
                                      self.scaling.num_workers if self._elastic is not None else None)
            if done is not None:
                self._complete_round(group, done)
        elif isinstance(message, JIT_MESSAGES):
            self._jit.take(group, rank, message)
        elif isinstance(message, Rendezvous):
            for other in range(1, rounds.num_workers):
                group.send(other, message)
        elif isinstance(message, Gather):
            answer = self._collectives.add(rank, message)
            if answer is not None:
                send_each(group, rounds.running, answer)
        elif isinstance(message, Done):
            rounds.finish(rank, message.reports)
            group.mark_finished(rank)
        elif isinstance(message, (Failed, WorkerDied)):
            rounds.fail(rank)
            if isinstance(message, WorkerDied):
                record(failures, rank, message, time.time())
            else:
                record(failures, rank, worker_exception(rank, message.traceback, message.error), message.at)
        else:
            raise TypeError(f"rank {rank} sent an unknown message {message!r}")

    def _complete_round(self, group: WorkerGroup, done: Round) -> None:
        """Every rank reported round `done` and it is recorded: get a restart ready once the
        attempt has run a while, and reply to each rank whether to checkpoint or stop."""
        self._warm_up_when_due(group)
        reply = self._reply(done)
        for rank in range(self.scaling.num_workers):
            group.send(rank, reply)

    def _warm_up_when_due(self, group: WorkerGroup) -> None:
        """Once the attempt has run WARM_UP_AFTER_S (at its first round when it follows a failure:
        the run fails often) and a failure would be retried, have the group get a restart ready
        in the background (the ranks are in their loop by now)."""
        due = 0.0 if getattr(self.policy, "failures", 0) else WARM_UP_AFTER_S
        if self._cold and time.monotonic() - self._started >= due and self.policy.can_retry():
            self._cold = False
            group.warm_up()

    def _reply(self, done: Round) -> Reply:
        """The pipeline's reply to round `done`; while Stopping for a signal or a resize, ask
        for a checkpoint, then stop (`done.saved`: the round has a checkpoint)."""
        state = self.state
        if not isinstance(state, states.Stopping):
            return self._reports.reply(done)
        committed = self._reports.committed(done.iteration)
        if state.asked_at is None:
            self._transition(state.asking_at(done.iteration))
            return Reply(stop=done.stop, checkpoint=True, committed=committed,
                         verdict_at=stop_due_at(self.run_config.stop), attach=done.attach)
        self._transition(state.stopping_workers())
        if not done.saved:
            latest = self.run.checkpoints.latest
            log.warning("run %s: the training loop did not attach a checkpoint to report %d when asked "
                        "(train.get_context().should_checkpoint() was true); a restore resumes from %s",
                        self.run.path, done.iteration, latest.name if latest else "the start")
        return Reply(stop=True, checkpoint=False, committed=committed, attach=done.attach)
