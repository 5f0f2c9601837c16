"""Whether a sweep on a Ray cluster has room for one more trial, counting what each running
trial holds now.

On the local engine a trial always holds its `max_workers` (the machine runs any number of
worker processes), so the sweep's concurrency is fixed up front from this machine's CPUs. On
a Ray cluster the trials share the cluster's worker slots, and an elastic trial
(`num_workers=(min_workers, max_workers)`) holds what it was placed with, which changes as
it shrinks and grows. So the sweep starts the next trial only when the slots the running
trials hold now, plus the next trial's `min_workers`, fit in the cluster: a trial never
starts only to wait for capacity that its siblings hold, and an elastic trial that got less
than its most leaves room for the next.

What a running trial holds is read from its run: the size of its attempt under way, its
`max_workers` between two attempts, and before its first attempt the share it was started
with. That share also caps its first attempt (`ElasticScaler(start_limit=...)`): trials
started a moment apart do not count the same free slots, whatever order their workers are
placed in.
"""

from __future__ import annotations

from dataclasses import dataclass

from unbroken.errors import UnbrokenError
from unbroken.store import manifest as mf
from unbroken.store.storage import Storage


@dataclass(frozen=True)
class TrialSlots:
    """The admission rule of one sweep on a Ray cluster (see the module docstring)."""

    slots: int  # the worker slots of the cluster's live nodes, free or not
    need: int   # what the next trial needs to start: its min_workers
    most: int   # what a trial holds at most: its max_workers

    def share(self, holding: list[int]) -> int:
        """The most workers the next trial may start with, given what each running trial
        holds now; 0 when it does not fit now. With no trial running, always at least
        `need`: a trial larger than the cluster then fails with the placement error, as it
        would alone. The share caps the trial's first attempt only; it grows later as any
        elastic run does, when more can be placed."""
        free = self.slots - sum(holding)
        if holding and free < self.need:
            return 0
        return min(self.most, max(self.need, free))


def holding(trial: Storage, most: int) -> int | None:
    """The workers trial run `trial` holds now: its running attempt's size; `most` between
    two attempts (a resize may take that many); None before its first attempt, or while its
    run cannot be read for a moment."""
    try:
        if not mf.is_run_dir(trial):
            return None
        run = mf.load(trial)
    except (UnbrokenError, OSError):
        return None
    if not run.attempts:
        return None
    last = run.attempts[-1]
    return last.num_workers if last.status == mf.RUNNING else most
