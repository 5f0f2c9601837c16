"""The controller: drives one run through its attempts.

Each attempt starts (or, after a recovery in place, rejoins) a worker group and runs one
attempt loop on it (`attempt_loop`): the reports become rows and checkpoints through the
report pipeline (`report_pipeline`). When an attempt fails, recovery (`recovery`) settles
what can be saved and, with the failure policy handed in, says what follows: a recovery
in place, a restart from the latest committed checkpoint, or giving up. A preemption notice
(`notices`) or an elastic resize stops the attempt at a checkpoint. The controller's state
(`controller_state`) changes only in `_transition`. The worker group is the engine's
business; storage is the Run's.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any, ClassVar

from unbroken.core import faults
from unbroken.core.config import RunConfig, ScalingConfig
from unbroken.errors import (
    InsufficientResourcesError,
    LeaseLostError,
)
from unbroken.execution import controller_state as states
from unbroken.execution.attempt_endings import AttemptEndings
from unbroken.execution.attempt_loop import AttemptLoop
from unbroken.execution.elastic import CapacityProbe, ElasticScaler, Unbounded
from unbroken.execution.engine.base import Placement, WorkerGroup, WorkerGroupFactory
from unbroken.execution.notices import MetadataWatch
from unbroken.execution.preemption import Interrupts
from unbroken.execution.rank_payload import rank_payload
from unbroken.execution.recovery.after_failure import Recovery, record_safely
from unbroken.execution.recovery.failure_policy import FailurePolicy
from unbroken.execution.recovery.in_place import InPlacePlan
from unbroken.execution.report_pipeline import ReportPipeline
from unbroken.execution.validations import ValidationRunner, Validations
from unbroken.execution.worker_failures import first_line, give_up_error
from unbroken.run.handle import Run
from unbroken.store import manifest as mf
from unbroken.store.commit import Marker
from unbroken.worker.runner import PROBE

log = logging.getLogger("unbroken")


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
        self._spot = MetadataWatch(self.run_config.failure_config.preemption_notices)  # if asked for
        # Workers get the trainer without the driver-side callbacks (never called there, and
        # a callback may hold something that cannot travel to a forkserver worker).
        self._worker_trainer = copy.copy(trainer)
        self._worker_trainer.run_config = dataclasses.replace(trainer.run_config, callbacks=None)
        validation = getattr(trainer, "validation_config", None)
        self._worker_trainer.validation_config = None  # a validation runs in the driver's validations only
        self._validations = Validations(run, validation, validation_runner)
        self._reports = ReportPipeline(run, self.run_config)  # rows, commits, replies
        # An elastic run (num_workers=(min, max)): each attempt's size, from the engine's `capacity`.
        self._elastic = (ElasticScaler(self.scaling, capacity or Unbounded(),
                                       start_limit=trainer.run_spec.elastic_start_limit)
                         if self.scaling.elasticity_enabled else None)
        self._recovery = Recovery(run, self.run_config.failure_config, self.policy, self._elastic)
        self._endings = AttemptEndings(run, self.run_config, self._recovery, self.interrupts, restore_hint,
                                       lambda: self.state, self._transition)
        self._placements: list[Placement] = []  # the attempt's ranks, by rank

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
        """Run the step of the state the controller is in (`STEPS`) until it is terminal:
        FINISHED returns; raises TrainingFailedError when the policy gives up and
        TrainingInterruptedError on SIGTERM/SIGINT."""
        with self.interrupts:
            self._spot.start()
            try:
                while not self._state.is_terminal():
                    self.STEPS[type(self._state)](self)
            finally:
                self._spot.close()
                self._validations.close()  # one still in flight runs again under the next driver
                self._recovery.close()
                record_safely(self.run, self.run.lease.release)  # also when an attempt could not even begin

    def _next_attempt(self) -> None:
        """RESTARTING, RESIZING or PREEMPTED: the next attempt is STARTING."""
        self._transition(states.Starting(self.run.manifest.attempt_count + 1))

    def _begin(self) -> None:
        """STARTING: begin the attempt in the run's records and start its ranks -> RUNNING (a
        signal seen before it -> INTERRUPTED)."""
        if self.interrupts.count:
            self._endings.interrupted()
        self._placements = []
        rejoin = self._recovery.staying()
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
            group = (rejoin[0] if rejoin is not None
                     else self.group_factory(self.scaling, warm=self._recovery.warm))
            self._start(group, resume, attempt, peer)
        except BaseException as error:
            self._failed(group, None, error, attempt)

    def _drive(self) -> None:
        """RUNNING: the attempt's event loop (`attempt_loop`), then what its end means: FINISHED,
        or where its stop (a resize, a preemption) or its failure leads."""
        running = self._state
        assert isinstance(running, states.Running) and running.group is not None
        group, attempt = running.group, running.attempt
        loop = AttemptLoop(group, self.run, self.run_config, self.scaling.num_workers, self._reports,
                           self._recovery, self._validations, self.interrupts, self._spot, self._elastic,
                           lambda: self.state, self._transition)
        try:
            loop.drive()
        except BaseException as error:
            self._failed(group, loop, error, attempt)
            return
        group.shutdown()
        if isinstance(self.state, states.Stopping) and self.state.stopped:
            if self.state.resize_to is None:
                if not self._endings.preempted():
                    self._endings.interrupted()
                return
            self.run.end_attempt(mf.RESIZED)
            faults.point("after_resize_stop")  # crash tests: between the two attempts of a resize
            self._transition(states.Resizing(attempt, self.state.resize_to))
            return
        self._validations.wait_all()  # the Result shows every checkpoint's validation ended
        self.run.end_attempt(mf.FINISHED)
        self.run.finish(mf.FINISHED)
        self._transition(states.Finished())

    def _failed(self, group: WorkerGroup | None, loop: AttemptLoop | None, error: BaseException,
                attempt: int) -> None:
        """Attempt `attempt` failed with `error`: recovery settles what can be saved from the
        group, then the failure policy says RESTARTING (or PREEMPTED), or the run ends
        ERRORED/INTERRUPTED and this raises."""
        if group is not None:
            preempted = states.notice_of(self.state) is not None
            self._recovery.hand_back(group, error, loop.failures if loop else [], self._placements, preempted)
        if isinstance(error, LeaseLostError):
            raise error  # the run belongs to another driver now: write nothing more to it
        if self._endings.gives_up(error, attempt):
            if not isinstance(error, Exception):
                raise error
            raise give_up_error(error,
                f"training failed in attempt {attempt} of run {self.run.path!r}: {first_line(error)}\n"
                f"The run and its checkpoints are kept. After fixing the cause, continue it with "
                f"{self.restore_hint}") from error

    def _size_attempt(self, peer: InPlacePlan | None) -> dict[str, Any]:
        """An elastic run: size this attempt (`ElasticScaler.size`). Returns the attempt's
        record; ends the run as ERRORED when too few workers can be placed in time."""
        try:
            held = peer.size if peer is not None else None
            self.scaling, record = self._elastic.size(self._recovery.warm, held)
        except InsufficientResourcesError as error:
            self._transition(states.Errored(error))
            record_safely(self.run, self.run.finish, mf.ERRORED)
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
        self._recovery.starting()
        probe = self.run.write_probe(PROBE) if group.spans_machines else None
        payload = functools.partial(
            rank_payload, self.run, self._worker_trainer, self.scaling, self._validations.config is not None,
            resume, probe, (peer.source, peer.iteration) if peer is not None else None)
        if peer is not None and peer.dropped:
            group.drop(set(peer.dropped))
        self._placements = (group.rejoin(payload, set(peer.replaced)) if peer is not None
                            else group.start(payload))
        self._recovery.started()
        self._transition(states.Running(attempt, group))

    # The step of each non-terminal state the controller can be in between steps (STOPPING
    # lives inside RUNNING's step: the attempt loop enters it, and its end leaves it).
    STEPS: ClassVar[dict[type[states.ControllerState], Callable[[Controller], None]]] = {
        states.Starting: _begin, states.Running: _drive,
        states.Restarting: _next_attempt, states.Resizing: _next_attempt, states.Preempted: _next_attempt}
