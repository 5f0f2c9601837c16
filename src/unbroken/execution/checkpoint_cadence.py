"""When a loop that reports with `TrainState.report(..., checkpoint="auto")` saves next.

The driver follows the Young/Daly advice (`run.checkpoint_advice`): after each round it
adds the round's training time (its iteration time less its save) to the time since the
last save, and asks the ranks to save at their next report (the reply's `checkpoint`, as
for a preemption) once that, plus one more iteration, reaches the advised interval. The
cost of a save is the median of this fit()'s saves so far: the first auto report saves, to
measure it. The mean time between failures is the one `CheckpointConfig` gives, else the
attempts' time per failed attempt so far, else an hour. Pure: the time is passed in.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any

from unbroken.run.checkpoint_advice import FAILED, mtbf, young_interval
from unbroken.store import manifest as mf

COSTS_KEPT = 8  # the saves whose median is the cost: recent enough to follow a change in size


class Cadence:
    """The driver's bookkeeping for `checkpoint="auto"` within one fit()."""

    def __init__(self, mtbf_s: float | None) -> None:
        self.mtbf_s = mtbf_s
        self.costs: deque[float] = deque(maxlen=COSTS_KEPT)
        self.since = 0.0  # training seconds since the last save
        self.interval_s: float | None = None  # the interval it follows now

    def due(self, row: dict[str, Any], saved: bool, attempts: list[Any], now: float) -> bool:
        """Round `row` is recorded (`saved`: it carried a checkpoint); `attempts`: the run's
        (with `status`, `started_at`, `ended_at`, and the last one's `stall_s`). Whether the
        ranks should save at their next report."""
        stall = attempts[-1].stall_s(row.get("training_iteration")) if saved else None
        took = max(0.0, float(row.get("time_this_iter_s") or 0.0) - float(stall or 0.0))
        if saved:
            if stall is not None:
                self.costs.append(float(stall))
            self.since = 0.0
        else:
            self.since += took
        if not self.costs:
            return True  # nothing measured yet: save once to learn what a save costs
        failures = sum(a.status in FAILED for a in attempts)
        wall = sum((a.ended_at or (now if a.status == mf.RUNNING else a.started_at)) - a.started_at
                   for a in attempts)
        self.interval_s = young_interval(statistics.median(self.costs), mtbf(failures, wall, self.mtbf_s)[0])
        return self.since + took >= self.interval_s
