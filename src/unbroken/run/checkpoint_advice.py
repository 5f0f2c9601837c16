"""How often to checkpoint: the Young/Daly interval from what a save costs and how often the
run fails, and the goodput to expect at an interval.

Pure. A save costs `cost_s` of blocked training; a failure, on average, `recovery_s` plus
the work since the last checkpoint (half an interval). With failures every `mtbf_s`
seconds, checkpointing every `interval_s` seconds of training wastes about
`cost_s / interval_s` of the time to saves and `(recovery_s + interval_s / 2) / mtbf_s` to
failures; the interval that wastes least is Young's `sqrt(2 * cost_s * mtbf_s)` (Daly's
refinement changes it by less than the measurement's noise while the cost is small against
the MTBF). `unbroken show` prints the advice; `TrainState.report(..., checkpoint="auto")`
follows it (`execution.checkpoint_cadence`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from unbroken.run import goodput as gp
from unbroken.store import manifest as mf

# The mean time between failures assumed while a run has seen none and none was given: an
# hour, the order of what large jobs see (Meta's cluster study: a failure every few hours per
# thousand GPUs); `CheckpointConfig(mean_time_between_failures_s=...)` sets it.
DEFAULT_MTBF_S = 3600.0
FAILED = (mf.ERRORED, mf.ABORTED)


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """The checkpoint interval (seconds of training) that wastes least: sqrt(2 cost mtbf)."""
    return math.sqrt(2 * max(cost_s, 0.0) * mtbf_s)


def expected_goodput(interval_s: float, cost_s: float, mtbf_s: float, recovery_s: float) -> float:
    """The share of the time that trains, checkpointing every `interval_s` s of training
    (first order: start-up and waiting left out)."""
    if interval_s <= 0:
        return 0.0
    return max(0.0, interval_s / (interval_s + cost_s) - (recovery_s + (interval_s + cost_s) / 2) / mtbf_s)


@dataclass(frozen=True)
class Advice:
    """What `unbroken show` prints about the checkpoint interval (seconds of training)."""

    cost_s: float  # the median time a save blocked training
    interval_s: float | None  # the run's median training time between two saves (None: < 2 saves)
    mtbf_s: float  # the mean time between failures used
    failures: int  # failed attempts seen (a killed driver's included)
    given: bool  # mtbf_s was given, not observed
    recovery_s: float  # the mean recovery per failure seen (0 without failures)
    advised_s: float  # Young's interval

    def expected(self, interval_s: float) -> float:
        return expected_goodput(interval_s, self.cost_s, self.mtbf_s, self.recovery_s)


def mtbf(failures: int, wall_s: float, given_s: float | None) -> tuple[float, bool]:
    """(the mean time between failures to use, whether it was given): the one given, else the
    wall time per failure seen, else DEFAULT_MTBF_S."""
    if given_s is not None:
        return given_s, True
    if failures and wall_s > 0:
        return wall_s / failures, False
    return DEFAULT_MTBF_S, False


def advise(attempts: list[dict[str, Any]], rows: list[dict[str, Any]], time: gp.Goodput,
           mtbf_s: float | None = None) -> Advice | None:
    """The advice for a run (its attempts and rows, and where its time went), or None before
    it saved a checkpoint with its cost measured."""
    rows = gp.with_stalls(attempts, rows)
    saves = [r for r in rows if r.get("time_checkpoint_s") is not None]
    if not saves:
        return None
    failures = sum(a.get("status") in FAILED for a in attempts)
    used, given = mtbf(failures, time.wall_s, mtbf_s)
    between = _between_saves(rows)
    cost = statistics.median(r["time_checkpoint_s"] for r in saves)
    return Advice(cost_s=cost, interval_s=statistics.median(between) if between else None, mtbf_s=used,
                  failures=failures, given=given,
                  recovery_s=time.seconds[gp.RECOVERY] / failures if failures else 0.0,
                  advised_s=young_interval(cost, used))


def _between_saves(rows: list[dict[str, Any]]) -> list[float]:
    """The training time (iteration time less saves) from each save to the next in an attempt."""
    out, since, attempt = [], None, None
    for r in rows:
        if r.get("attempt") != attempt:
            since, attempt = None, r.get("attempt")
        took = max(0.0, float(r.get("time_this_iter_s") or 0.0) - float(r.get("time_checkpoint_s") or 0.0))
        if since is not None:
            since += took
        if r.get("time_checkpoint_s") is not None:
            if since is not None:
                out.append(since)
            since = 0.0
    return out
