"""Where a run's time went: its wall-clock time cut into what trained and what did not.

Pure: it reads the attempts of run.json and every row of result.json (`history.read_rows`,
redone rows included) and nothing else, so the figures are as durable as those files, and
a killed driver's attempt is reconstructed from its rows (it ends at its last row). The
terms, defined for users in docs/guarantees.md ("Where the time went"):

- **wall**: per `fit()`, from its start to the end of its last attempt, summed over the
  fit() calls. The time between a killed or stopped driver and the next fit() is no driver
  running: reported apart (`between_fits_s`), not in the wall time.
- **productive**: the iterations the run's history keeps (each iteration once), less the
  time their report was blocked saving.
- **checkpoint**: the time report calls were blocked saving (an attempt's `checkpoint_stalls`;
  `time_checkpoint_s` in the rows of older runs): the slowest rank's, from the start of
  TrainState's save, or of `train.report`'s staging, to the report's send; an asynchronous
  save counts its snapshot.
- **startup**: from fit() to the first iteration's start.
- **recovery**: from a failed (or resized) attempt's last row to the next attempt's first
  iteration's start: the lost partial iteration, detection, the just-in-time save, teardown,
  the start of the new workers and the restore.
- **redone**: iterations computed and then dropped from the history because a later attempt
  resumed from an earlier point.
- **waiting**: an elastic run waiting for capacity before an attempt (`elastic.waited_s`).
- **preemption**: from a preempted attempt's last row to its end (status PREEMPTED: a
  preemption notice stopped it at a checkpoint): the step given up or finished for the
  checkpoint, the just-in-time save and the stop.
- **other**: the rest: a finished attempt's end (teardown, the last commit and validations),
  a stopped attempt's end.

An attempt's first iteration is not timed from its start (the set-up before the loop is not
known to the driver): it is counted at the attempt's median iteration time, and the rest of
the time from the attempt's start to its first row is start-up or recovery. Goodput is
productive / wall.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from unbroken.store import history
from unbroken.store import manifest as mf
from unbroken.store.storage import Storage

PRODUCTIVE, CHECKPOINT, STARTUP, RECOVERY = "productive", "checkpoint", "startup", "recovery"
REDONE, WAITING, PREEMPTION, OTHER = "redone", "waiting", "preemption", "other"
KINDS = (PRODUCTIVE, CHECKPOINT, STARTUP, RECOVERY, REDONE, WAITING, PREEMPTION, OTHER)
# What the time from an attempt's last row to its end went into, by the attempt's status.
_TAIL = {mf.ERRORED: RECOVERY, mf.RESIZED: RECOVERY, mf.PREEMPTED: PREEMPTION}
# Without fit_started_at (runs written before it was recorded), an attempt that began this soon
# after a failed or resized one ended is taken to be a restart within the same fit().
SAME_FIT_GAP_S = 120.0


@dataclass(frozen=True)
class Segment:
    """A stretch of the run's wall-clock time (time.time() seconds) and what it went into."""

    start: float
    end: float
    kind: str
    attempt: int


@dataclass
class Goodput:
    """A run's time by kind (`seconds`, over the whole run; `by_attempt`, per attempt number),
    the segments they add up from, and the wall time they add up to."""

    segments: list[Segment] = field(default_factory=list)
    between_fits_s: float = 0.0

    @property
    def seconds(self) -> dict[str, float]:
        return _total(self.segments)

    @property
    def by_attempt(self) -> dict[int, dict[str, float]]:
        out: dict[int, list[Segment]] = defaultdict(list)
        for s in self.segments:
            out[s.attempt].append(s)
        return {number: _total(segments) for number, segments in sorted(out.items())}

    @property
    def wall_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def goodput(self) -> float | None:
        """productive / wall, or None for a run with no time recorded yet."""
        wall = self.wall_s
        return self.seconds[PRODUCTIVE] / wall if wall > 0 else None

    def scalars(self) -> dict[str, float]:
        """The figures a metrics logger records: `goodput` and `time/<kind>_s`, and `time/wall_s`."""
        out = {f"time/{kind}_s": seconds for kind, seconds in self.seconds.items()}
        out["time/wall_s"] = self.wall_s
        if self.goodput is not None:
            out["goodput"] = self.goodput
        return out

    def to_json(self) -> dict[str, Any]:
        return {"goodput": self.goodput, "wall_s": self.wall_s, "between_fits_s": self.between_fits_s,
                "seconds": self.seconds,
                "by_attempt": {str(n): kinds for n, kinds in self.by_attempt.items()}}


def _total(segments: list[Segment]) -> dict[str, float]:
    out = dict.fromkeys(KINDS, 0.0)
    for s in segments:
        out[s.kind] += s.end - s.start
    return out


def of_storage(storage: Storage) -> Goodput:
    """The breakdown of the run directory `storage`, read from its files now."""
    manifest = mf.load(storage)
    return of_run([dataclasses.asdict(a) for a in manifest.attempts], history.read_rows(storage))


def with_stalls(attempts: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rows`, each that saved a checkpoint carrying its stall as `time_checkpoint_s` (from its
    attempt's `checkpoint_stalls`; rows of older runs carry it already)."""
    stalls = {a["number"]: a.get("checkpoint_stalls") for a in attempts}
    out = []
    for r in rows:
        stall = mf.checkpoint_stall(stalls.get(r.get("attempt")), r.get("training_iteration"))
        out.append(r if stall is None else {**r, "time_checkpoint_s": stall})
    return out


def of_run(attempts: list[dict[str, Any]], rows: list[dict[str, Any]]) -> Goodput:
    """The breakdown of a run from its attempts (run.json's, as dicts) and every row it wrote."""
    rows = with_stalls(attempts, rows)
    kept = {id(r) for r in history.timeline(rows)}
    own: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if isinstance(r.get("timestamp"), int | float):
            own[r.get("attempt")].append(r)
    for number in own:
        own[number].sort(key=lambda r: r["timestamp"])
    fallback = _median_step([r for number in own for r in own[number][1:]])
    out = Goodput()
    previous: dict[str, Any] | None = None
    previous_end = 0.0
    for a in attempts:
        mine = own.get(a["number"], [])
        start = a["started_at"]
        restart = previous is not None and _same_fit(previous, a, previous_end)
        lead_from = previous_end if restart else max(a.get("fit_started_at") or start, previous_end)
        if previous is not None and not restart:
            out.between_fits_s += max(0.0, lead_from - previous_end)
        start = max(start, lead_from)
        waited = min(float((a.get("elastic") or {}).get("waited_s") or 0.0), start - lead_from)
        lead = RECOVERY if restart else STARTUP
        _add(out, lead_from, start - waited, lead, a)
        _add(out, start - waited, start, WAITING, a)
        step = _median_step(mine[1:]) if len(mine) > 1 else fallback
        t = start
        for i, row in enumerate(mine):
            end = max(float(row["timestamp"]), t)
            stall = min(max(float(row.get("time_checkpoint_s") or 0.0), 0.0), end - t)
            work_from = t
            if i == 0:  # the attempt's set-up runs before its first step: not work
                work_from = end - stall - min(step, end - stall - t)
                _add(out, t, work_from, lead, a)
            # Kept even when empty (a save that took the whole interval): one per row.
            _add(out, work_from, end - stall, PRODUCTIVE if id(row) in kept else REDONE, a, empty=True)
            _add(out, end - stall, end, CHECKPOINT, a)
            t = end
        ended = a.get("ended_at") if a.get("status") != mf.ABORTED else None
        end = max(float(ended or t), t)
        _add(out, t, end, _TAIL.get(a.get("status"), OTHER), a)
        previous, previous_end = a, end
    return out


def _add(out: Goodput, start: float, end: float, kind: str, attempt: dict[str, Any],
         empty: bool = False) -> None:
    if end > start or (empty and end == start):
        out.segments.append(Segment(start, end, kind, attempt["number"]))


def _median_step(rows: list[dict[str, Any]]) -> float:
    """The median time an iteration took, its save left out (0 without rows to tell)."""
    steps = [max(0.0, float(r.get("time_this_iter_s") or 0.0) - float(r.get("time_checkpoint_s") or 0.0))
             for r in rows]
    return statistics.median(steps) if steps else 0.0


def _same_fit(previous: dict[str, Any], a: dict[str, Any], previous_end: float) -> bool:
    """Whether attempt `a` is a restart within the fit() of `previous`, not a later fit()."""
    if previous.get("fit_started_at") is not None or a.get("fit_started_at") is not None:
        return previous.get("fit_started_at") == a.get("fit_started_at")
    return previous.get("status") in (mf.ERRORED, mf.RESIZED) and \
        0 <= a["started_at"] - previous_end < SAME_FIT_GAP_S
