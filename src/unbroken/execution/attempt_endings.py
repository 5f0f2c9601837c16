"""How an attempt that did not finish ends: a failure the policy retries or gives up on, a
preemption notice that named some ranks' nodes (the run goes on without them), or an
interruption (a signal, a notice for the driver's machine: the run ends INTERRUPTED).

Each records the attempt's and the run's end, and moves the controller's state through the
`transition` it is given (`controller_state`); an interruption raises TrainingInterruptedError
with the restore hint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from unbroken.core.config import RunConfig
from unbroken.errors import TrainingInterruptedError
from unbroken.execution import controller_state as states
from unbroken.execution.notices import Notice
from unbroken.execution.preemption import Interrupts
from unbroken.execution.recovery.after_failure import Next, Recovery, record_safely
from unbroken.execution.worker_failures import first_line
from unbroken.run.handle import Run
from unbroken.store import manifest as mf

log = logging.getLogger("unbroken")


class AttemptEndings:
    """The ends of the attempts of `run` that did not finish. The controller's state is read
    with `state()` and changed only through `transition`."""

    def __init__(self, run: Run, run_config: RunConfig, recovery: Recovery, interrupts: Interrupts,
                 restore_hint: str, state: Callable[[], states.ControllerState],
                 transition: Callable[[states.ControllerState], None]) -> None:
        self.run, self.run_config, self.recovery = run, run_config, recovery
        self.interrupts, self.restore_hint = interrupts, restore_hint
        self.state, self.transition = state, transition

    def gives_up(self, error: BaseException, attempt: int) -> bool:
        """Close failed attempt `attempt`; ask the failure policy: False to restart, True (run closed)
        to raise `error`. Raises TrainingInterruptedError when a second signal stopped the workers,
        or when the attempt ended for a preemption notice (its ranks gave their step up, or
        failed, once the notice came): a preemption is not a failure, and where the notice named
        some ranks' nodes only, the run goes on (False)."""
        if self.preempted(error):
            return False
        if isinstance(self.state(), states.Interrupted) or states.notice_of(self.state()) is not None:
            self.interrupted()
        record_safely(self.run, self.run.end_attempt, mf.ERRORED, error)
        after = self.recovery.decide(error)
        if after is not Next.GIVE_UP:
            self.transition(states.Restarting(attempt, error))
            log.warning("run %s: attempt %d failed (%s); %s (failure %d of %s)", self.run.path, attempt,
                        first_line(error), after.value, getattr(self.recovery.policy, "failures", 0),
                        self.run_config.failure_config.max_failures)
            return False
        self.transition(states.Errored(error))
        status = mf.ERRORED if isinstance(error, Exception) else mf.INTERRUPTED
        record_safely(self.run, self.run.finish, status)
        return True

    def preempted(self, error: BaseException | None = None) -> bool:
        """An attempt stopped for a preemption notice that named some of its ranks' nodes (a Ray
        drain), cleanly or failing once the notice came: end it PREEMPTED and go on without those
        nodes, unless `max_preemption_failures` attempts of this fit() were preempted already.
        False where the run stops instead (`interrupted`): a notice for the driver's machine."""
        notice, attempt = states.notice_of(self.state()), self.run.attempt
        if notice is None or notice.ranks is None:
            return False
        limit = self.run_config.failure_config.max_preemption_failures
        before = sum(a.status == mf.PREEMPTED and a.fit_started_at == attempt.fit_started_at
                     for a in self.run.manifest.attempts)
        if limit != -1 and before >= limit:
            log.warning("run %s: %d attempts of this fit() were preempted, the most "
                        "FailureConfig(max_preemption_failures=%d) goes on after", self.run.path, before,
                        limit)
            return False
        self._end_preempted(notice, error)
        self.transition(states.Preempted(attempt.number, notice))
        log.warning("run %s: attempt %d preempted (%s, node %s, rank(s) %s); the next attempt runs without "
                    "that node", self.run.path, attempt.number, notice.source, notice.node,
                    list(notice.ranks))
        return True

    def _end_preempted(self, notice: Notice, error: BaseException | None = None) -> None:
        """End the attempt as PREEMPTED, with `notice` in its record."""
        self.run.attempt.preempted = notice.record()
        record_safely(self.run, self.run.end_attempt, mf.PREEMPTED, error)

    def interrupted(self) -> None:
        """Close the attempt (PREEMPTED after a preemption notice, with the notice in its
        record) and the run as INTERRUPTED, and raise with the restore hint."""
        notice = states.notice_of(self.state())
        if not isinstance(self.state(), states.Interrupted):  # a second signal made it so already
            self.transition(states.Interrupted(self.interrupts.signal_name))
        if self.run.attempt is not None and self.run.attempt.ended_at is None:
            if notice is not None:
                self._end_preempted(notice)
            else:
                self.run.end_attempt(mf.INTERRUPTED)
        self.run.finish(mf.INTERRUPTED)
        latest = self.run.checkpoints.latest
        where = (f"its latest committed checkpoint is {latest.name} (iteration {latest.iteration})"
                 if latest else "it has no committed checkpoint yet")
        cause = self.interrupts.signal_name if notice is None else f"a preemption notice ({notice.source})"
        raise TrainingInterruptedError(
            f"run {self.run.path!r} was interrupted by {cause}; {where}.\n"
            f"Continue it with {self.restore_hint}") from None
