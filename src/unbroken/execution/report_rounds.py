"""Report rounds: which rank reported which iteration, and when a round is complete.

`train.report` is collective: round N is complete once every rank has sent report N.
Reports are pipelined, so a rank is at most one round ahead of the slowest one and at
most one round is ever incomplete. When a rank fails, that incomplete round may still
complete: every rank that has not sent its report yet is alive and will reach it (the
failed rank passed every collective before its report, so they can too). The controller
keeps taking messages until `can_complete` says no, so a round every rank reported is
never lost to the failure that follows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from unbroken.errors import ReportMismatchError, WorkerHangError
from unbroken.worker.protocol import Report


@dataclass
class ReportRounds:
    """The driver's view of the reports of one attempt. Pure bookkeeping: it sends nothing,
    and times are given to it (`heard`, `hang_left`), so tests drive it directly."""

    num_workers: int
    last_heard: float = 0.0  # when a message last arrived (or the attempt began)
    pending: dict[int, dict[int, Report]] = field(default_factory=dict)
    reported: list[int] = field(default_factory=list)
    done: dict[int, int] = field(default_factory=dict)  # rank -> its report count when it finished
    failed: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.reported = [0] * self.num_workers

    @property
    def all_done(self) -> bool:
        return len(self.done) == self.num_workers

    @property
    def running(self) -> set[int]:
        """The ranks that have neither finished nor failed."""
        return set(range(self.num_workers)) - self.failed - set(self.done)

    def heard(self, now: float) -> None:
        """A message arrived at `now` (progress, for the hang timeout)."""
        self.last_heard = now

    def hang_left(self, now: float, hang_s: float) -> float:
        """Seconds until the group counts as hung (<= 0: it does), with no message since."""
        return self.last_heard + hang_s - now

    def add_report(self, rank: int, report: Report) -> dict[int, Report] | None:
        """Record one rank's report; returns the round's reports by rank once it is complete."""
        self.reported[rank] += 1
        round_ = self.pending.setdefault(report.iteration, {})
        round_[rank] = report
        if len(round_) < self.num_workers:
            return None
        return self.pending.pop(report.iteration)

    def finish(self, rank: int, reports: int) -> None:
        self.done[rank] = reports

    def fail(self, rank: int) -> None:
        self.failed.add(rank)

    def can_complete(self) -> bool:
        """True while an incomplete round can still complete: every rank missing from it is
        still running (neither failed nor finished)."""
        for by_rank in self.pending.values():
            missing = set(range(self.num_workers)) - set(by_rank)
            if missing and not missing & (self.failed | set(self.done)):
                return True
        return False

    def check_counts(self) -> None:
        """Raise ReportMismatchError once a finished rank shows the ranks reported unevenly."""
        done = self.done
        if done and (max(self.reported) > min(done.values()) or
                     (self.all_done and len(set(done.values())) > 1)):
            counts = ", ".join(f"rank {r}: {c}" for r, c in enumerate(self.reported))
            raise ReportMismatchError(
                f"train.report was called a different number of times on different ranks "
                f"({counts}). train.report is collective. Hint: call it on every rank the same "
                "number of times, and attach the checkpoint only where needed")

    def hang_error(self, hang_s: float) -> WorkerHangError:
        """The error for a group that made no progress for `hang_s`, naming the ranks missing."""
        waiting: list[int] = []
        if self.pending:
            iteration = min(self.pending)
            waiting = sorted(set(range(self.num_workers)) - set(self.pending[iteration]) - set(self.done))
            what = (f"rank(s) {waiting} did not report iteration {iteration} within {hang_s:g} s, while "
                    f"rank(s) {sorted(self.pending[iteration])} did")
        else:
            what = f"no worker reported within {hang_s:g} s (reports so far: {self.reported})"
        error = WorkerHangError(
            f"the worker group looks hung: {what}. Hint: look for a collective or barrier that only "
            "some ranks reach; if an iteration legitimately takes longer, raise "
            "FailureConfig(hang_timeout_s=...), or set it to None", rank=None)
        error.waiting = waiting  # the ranks the others waited for (Attempt.hang)
        return error
