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

What a running trial holds is read from its run: the size of its attempt under way, or its
`max_workers` while it has none (it is being sized, or is between the attempts of a resize).
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

    def admits(self, holding: list[int | None]) -> bool:
        """Whether one more trial fits, given what each running trial holds now (None: not
        known, counted at `most`). With no trial running, always: a trial larger than the
        cluster then fails with the placement error, as it would alone."""
        held = sum(self.most if h is None else h for h in holding)
        return not holding or held + self.need <= self.slots


def holding(trial: Storage) -> int | None:
    """The workers trial run `trial` holds now: its running attempt's size, or None when it has
    no attempt under way (not begun yet, between attempts, or unreadable for a moment)."""
    try:
        if not mf.is_run_dir(trial):
            return None
        run = mf.load(trial)
    except (UnbrokenError, OSError):
        return None
    last = run.attempts[-1] if run.attempts else None
    return last.num_workers if last is not None and last.status == mf.RUNNING else None
