"""One attempt's event loop: the driver takes the ranks' messages until every rank is done,
and raises the attempt's failure once nothing more can be saved from it.

Each message goes where it belongs: reports and staged files to the report pipeline
(`report_pipeline`), just-in-time offers to recovery (`recovery`), collective calls to
`collective_calls`, a rendezvous to the other ranks, a rank's end or failure to the round
bookkeeping (`report_rounds`). Failures are recorded, not raised, as they arrive; the loop
raises the root cause only once no incomplete round can complete and no pending checkpoint
can commit any more (or `ROUND_GRACE_S` passed), after recovery had its just-in-time say. A
preemption notice (`notices`: a signal, a rank's SIGTERM, a spot notice) asks for a
checkpoint at the next report and a stop after it (STOPPING), as does an elastic run that
can grow; near the notice's deadline, ranks that have not reported give their step up and
the last report round is saved just in time; a second signal stops at once (INTERRUPTED).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from unbroken.core.config import RunConfig, stop_due_at
from unbroken.errors import WorkerDied
from unbroken.execution import controller_state as states
from unbroken.execution.collective_calls import CollectiveCalls
from unbroken.execution.elastic import ElasticScaler
from unbroken.execution.engine.base import WorkerGroup, send_each
from unbroken.execution.notices import DrainWatch, MetadataWatch, Notice, machine_notice
from unbroken.execution.preemption import Interrupts
from unbroken.execution.recovery.after_failure import Failures, Recovery
from unbroken.execution.report_pipeline import ReportPipeline, Round
from unbroken.execution.report_rounds import ReportRounds
from unbroken.execution.validations import Validations
from unbroken.execution.worker_failures import record, root_cause, worker_exception
from unbroken.run.handle import Run
from unbroken.worker.protocol import (
    Done,
    Failed,
    Gather,
    Rendezvous,
    Reply,
    Report,
    Staged,
    Terminating,
    Validated,
)
from unbroken.worker.recovery.messages import JIT_MESSAGES, JitArmed

log = logging.getLogger("unbroken")

POLL_S = 1.0
# How long a failed group's incomplete round may take to complete (the other ranks are
# finishing the step the failed rank already reported; see `report_rounds`).
ROUND_GRACE_S = 10.0
VALIDATION_POLL_S = 0.1  # how often a validation in flight is looked at (polled, not in the group's wait)


class StopNow(BaseException):
    """A second signal: stop the workers without waiting for anything."""


class RoundGaps:
    """The longest time between two of an attempt's completed report rounds (None before the
    second one); times are passed in."""

    def __init__(self) -> None:
        self.longest: float | None = None
        self._last: float | None = None

    def completed(self, now: float) -> None:
        if self._last is not None:
            gap = now - self._last
            self.longest = gap if self.longest is None else max(self.longest, gap)
        self._last = now


class AttemptLoop:
    """The driver's side of one attempt on `group` (`drive`). The controller's state is read
    with `state()` and changed only through `transition`."""

    def __init__(self, group: WorkerGroup, run: Run, run_config: RunConfig, num_workers: int,
                 reports: ReportPipeline, recovery: Recovery, validations: Validations,
                 interrupts: Interrupts, spot: MetadataWatch, elastic: ElasticScaler | None,
                 state: Callable[[], states.ControllerState],
                 transition: Callable[[states.ControllerState], None]) -> None:
        self.group, self.run, self.run_config, self.num_workers = group, run, run_config, num_workers
        self.reports, self.recovery, self.validations = reports, recovery, validations
        self.interrupts, self.spot, self.elastic = interrupts, spot, elastic
        self.state, self.transition = state, transition
        self.rounds = ReportRounds(num_workers, last_heard=time.monotonic())
        self.collectives = CollectiveCalls(num_workers)
        self.failures: Failures = []  # (rank, its error or WorkerDied), in the order they happened
        self.round_gaps = RoundGaps()  # for an automatic hang bound
        self.drains = DrainWatch()  # on Ray: the nodes drained for preemption

    def drive(self) -> None:
        """Take messages until every rank is done; raise the attempt's failure, if any.

        Leaves the state STOPPING when the workers stopped for a preemption or a resize, and
        INTERRUPTED (with the workers still running) on a second signal."""
        group, rounds, failures = self.group, self.rounds, self.failures
        self.reports.start_attempt()
        failed_at = 0.0
        signals = 0
        try:
            while not rounds.all_done:
                hang_s = self.run_config.failure_config.hang_bound(self.round_gaps.longest)
                self.run.lease.beat()
                signals = self._take_signals(signals)
                grace = self.run_config.failure_config.sigterm_grace_s
                for notice in [self.spot.take(), *self.drains.take(group, time.monotonic(), grace)]:
                    if notice is not None:
                        self._preempt(notice)
                if self.elastic is not None and isinstance(self.state(), states.Running) and not failures:
                    self._grow_when_possible()
                now = time.monotonic()
                timeout = POLL_S
                if failures:
                    can_complete = rounds.can_complete() or self.reports.can_complete(rounds.failed)
                    if not can_complete or now - failed_at >= ROUND_GRACE_S:
                        self.recovery.save_just_in_time(group, self.num_workers, failures, rounds.last_heard,
                                                        lambda: rounds.running, self._events,
                                                        self.reports.commit_late,
                                                        stay=states.notice_of(self.state()) is None)
                        raise root_cause(group, failures)
                    timeout = min(timeout, failed_at + ROUND_GRACE_S - now)
                if hang_s is not None:
                    timeout = max(0.0, min(timeout, rounds.hang_left(now, hang_s)))
                for name in self.validations.poll():
                    send_each(group, rounds.running, Validated(name))
                if self.validations.busy:
                    timeout = min(timeout, VALIDATION_POLL_S)
                timeout = min(timeout, self._abandon_when_due(time.time()))
                events = group.poll(timeout, wake=self.interrupts)
                now = time.monotonic()
                if events:
                    rounds.heard(now)
                elif hang_s is not None and rounds.hang_left(now, hang_s) <= 0 and not failures:
                    self.recovery.hung(group, rounds.hang_error(hang_s), rounds.running, failures)
                for rank, message in events:
                    self._take(rank, message)
                if failures:
                    failed_at = failed_at or now
                else:
                    rounds.check_counts()
        finally:
            self.reports.close()  # the rounds behind a save that never committed

    def _events(self, timeout: float) -> Iterator[tuple[int, Any]]:
        """The group's next events, each taken already (for recovery's waits)."""
        for rank, message in self.group.poll(timeout):
            self._take(rank, message)
            yield rank, message

    def _take_signals(self, seen: int) -> int:
        """React to SIGTERM/SIGINT received since `seen` of them: the first asks for a
        checkpoint and a stop (STOPPING; a SIGTERM is a preemption notice, see `_preempt`),
        another one stops at once. Returns the count."""
        count = self.interrupts.count  # once: another signal may land while this one is logged
        if count <= seen:
            return seen
        state, name = self.state(), self.interrupts.signal_name
        if count > 1 or (isinstance(state, states.Stopping) and state.signal is not None):
            log.warning("run %s: %s again: stopping the workers now", self.run.path, name)
            self.transition(states.Interrupted(name))
            raise StopNow
        if name == "SIGTERM":
            grace = self.run_config.failure_config.sigterm_grace_s
            self._preempt(machine_notice(name, time.time(), grace), signal=name)
        elif states.notice_of(state) is not None:
            self.transition(dataclasses.replace(state, signal=name))
        else:
            self.transition(states.Stopping(self.run.attempt.number, name))
            log.warning("run %s: %s received: the workers checkpoint at their next report, then stop "
                        "(send it again to stop at once)", self.run.path, name)
        return count

    def _preempt(self, notice: Notice, signal: str | None = None) -> None:
        """A preemption notice: ask for a checkpoint at the next report and a stop after it
        (STOPPING; a resize under way becomes this stop); several become one (`Notice.merged`)."""
        state = self.state()
        if states.notice_of(state) is not None:
            self.transition(dataclasses.replace(state, notice=state.notice.merged(notice),
                                                signal=state.signal or signal))
            return
        self.transition(states.Stopping(self.run.attempt.number, signal, notice=notice))
        again = " (send the signal again to stop at once)" if signal else ""
        log.warning("run %s: preemption notice (%s): the workers checkpoint at their next report, then "
                    "stop; %s goes in %.0f s%s", self.run.path, notice.source, notice.node,
                    notice.deadline - time.time(), again)

    def _abandon_when_due(self, now: float) -> float:
        """Near a notice's deadline (`Notice.abandon_at`), while the checkpoint asked for has
        not come: have the running ranks give their step up (`WorkerGroup.interrupt`), so
        that the last report round is saved just in time. Returns how long until then."""
        state = self.state()
        if not isinstance(state, states.Stopping) or state.notice is None or state.abandoned or state.stopped:
            return POLL_S
        left = state.notice.abandon_at - now
        if left > 0:
            return left
        running, named = self.rounds.running, state.notice.ranks
        ranks = sorted(running if named is None else set(named) & running)
        log.warning("run %s: rank(s) %s did not report since the preemption notice, %.1f s before its "
                    "deadline: they give their step up, and the last report round is saved just in time",
                    self.run.path, ranks, state.notice.deadline - now)
        self.transition(dataclasses.replace(state, abandoned=True))
        interrupt = getattr(self.group, "interrupt", None)
        if interrupt is not None:
            interrupt(set(ranks))
        return POLL_S

    def _grow_when_possible(self) -> None:
        """An elastic run below max_workers: when a check is due and more workers can be placed,
        ask for a checkpoint at the next report and a stop after it (then a larger attempt)."""
        target = self.elastic.grow_to(self.group.idle_slots)
        if target is not None:
            self.transition(states.Stopping(self.run.attempt.number, None, resize_to=target))
            log.info("run %s: %d workers can be placed now; resizing from %d at the next report's "
                     "checkpoint", self.run.path, target, self.num_workers)

    def _take(self, rank: int, message: Any) -> None:
        """Handle one event from the group; a failure is recorded in `failures`, not raised."""
        group, rounds = self.group, self.rounds
        if isinstance(message, (Report, Staged)):
            done = self.reports.take(group, rounds, rank, message,
                                     self.num_workers if self.elastic is not None else None)
            if done is not None:
                self.round_gaps.completed(time.monotonic())
                self.recovery.warm_up_when_due(group)
                reply = self._reply(done)
                for each in range(self.num_workers):
                    group.send(each, reply)
        elif isinstance(message, JIT_MESSAGES):
            self.recovery.jit.take(group, rank, message)
            if isinstance(message, JitArmed):
                self.recovery.armed(self.num_workers)
        elif isinstance(message, Terminating):
            grace = self.run_config.failure_config.sigterm_grace_s
            self._preempt(machine_notice(f"{message.source} to rank {rank}", message.at, grace))
        elif isinstance(message, Rendezvous):
            for other in range(1, self.num_workers):
                group.send(other, message)
        elif isinstance(message, Gather):
            answer = self.collectives.add(rank, message)
            if answer is not None:
                send_each(group, rounds.running, answer)
        elif isinstance(message, Done):
            rounds.finish(rank, message.reports)
            group.mark_finished(rank)
        elif isinstance(message, WorkerDied):
            rounds.fail(rank)
            record(self.failures, rank, message, time.time())
        elif isinstance(message, Failed):
            rounds.fail(rank)
            record(self.failures, rank, worker_exception(rank, message.traceback, message.error), message.at)
        else:
            raise TypeError(f"rank {rank} sent an unknown message {message!r}")

    def _reply(self, done: Round) -> Reply:
        """The pipeline's reply to round `done`; while STOPPING for a signal or a resize, ask
        for a checkpoint, then stop (`done.saved`: the round has a checkpoint)."""
        state = self.state()
        if not isinstance(state, states.Stopping):
            return self.reports.reply(done)
        committed = self.reports.committed(done.iteration)
        info = state.notice.info(self.num_workers) if state.notice is not None else None
        if state.asked_at is None:
            self.transition(state.asking_at(done.iteration))
            return Reply(stop=done.stop, checkpoint=True, committed=committed,
                         verdict_at=stop_due_at(self.run_config.stop), attach=done.attach, preemption=info)
        self.transition(state.stopping_workers())
        if not done.saved:
            latest = self.run.checkpoints.latest
            log.warning("run %s: the training loop did not attach a checkpoint to report %d when asked "
                        "(train.get_context().should_checkpoint() was true); a restore resumes from %s",
                        self.run.path, done.iteration, latest.name if latest else "the start")
        return Reply(stop=True, checkpoint=False, committed=committed, attach=done.attach, preemption=info)
