"""Naming the rank that holds everyone up.

In data-parallel training the slowest rank sets every rank's pace: the others wait for it in
the gradient all-reduce, so their step times say nothing. What differs is the time each rank
spends in its own forward pass (`unbroken.worker.forward_clock`, sent with every report).
A rank is a straggler when, over the last `window` reports, its median forward time is at
least `ratio` times the median of the other ranks' medians, judged once at least
`min_reports` reports are in (one slow round is noise; a straggler is consistently slow).

Pure bookkeeping, as `report_rounds` is: the controller feeds it each complete round.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

WINDOW = 10  # reports
MIN_REPORTS = 5
RATIO = 1.5


@dataclass(frozen=True)
class Straggler:
    """`rank` spent `ratio` times as long in its forward passes as the other ranks did."""

    rank: int
    ratio: float


@dataclass
class Stragglers:
    """The recent forward times of each rank of one attempt."""

    window: int = WINDOW
    min_reports: int = MIN_REPORTS
    ratio: float = RATIO
    _seconds: dict[int, deque[float]] = field(default_factory=dict)
    _ranks: int = 0  # how many ranks reported, measured or not

    def add(self, forward_s: dict[int, float | None]) -> None:
        """One complete round: each rank's forward seconds since its previous report (None:
        not measured, e.g. a model not wrapped by `prepare_model`)."""
        self._ranks = max(self._ranks, max(forward_s, default=-1) + 1)
        for rank, seconds in forward_s.items():
            if seconds is not None:
                self._seconds.setdefault(rank, deque(maxlen=self.window)).append(seconds)

    def medians(self) -> dict[int, float]:
        """Each measured rank's median forward seconds per report over the window, once it
        has `min_reports` of them."""
        return {rank: statistics.median(s) for rank, s in sorted(self._seconds.items())
                if len(s) >= self.min_reports}

    def straggler(self, medians: dict[int, float] | None = None) -> Straggler | None:
        """The slowest rank, when it is at least `ratio` times as slow as the others (from
        `medians` when given: what `medians()` returns now)."""
        medians = self.medians() if medians is None else medians
        if len(medians) < 2:
            return None
        slowest = max(medians, key=medians.__getitem__)
        others = statistics.median(s for r, s in medians.items() if r != slowest)
        if others <= 0:
            return None
        ratio = medians[slowest] / others
        return Straggler(slowest, round(ratio, 2)) if ratio >= self.ratio else None

    def summary(self) -> dict[str, Any] | None:
        """What the attempt record keeps (`Attempt.forward_s`): each rank's median forward
        seconds per report, in rank order (None: not measured yet), and the straggler if any;
        None until some rank has `min_reports` reports."""
        medians = self.medians()
        if not medians:
            return None
        straggler = self.straggler(medians)
        return {"median_s": [round(medians[r], 6) if r in medians else None
                             for r in range(self._ranks)],
                "straggler": asdict(straggler) if straggler else None}
