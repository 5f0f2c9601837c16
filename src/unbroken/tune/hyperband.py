"""Synchronous HyperBand (Ray Tune's `HyperBandScheduler`), with its decisions on disk.

Brackets are Ray's: with s_max + 1 = round(log(max_t) / log(reduction_factor)) + 1 brackets
per band, bracket s (from s_max down to 0) holds n0(s) = ceil((s_max + 1) / (s + 1) * eta**s)
trials and first judges them at r0(s) = max_t * eta**-s. Trials fill the brackets in the
order they are proposed, band after band, so a trial's bracket is a function of its index,
the same for every driver of the sweep. In a bracket, every trial runs to the rung's
milestone and pauses there; once every unfinished trial of the bracket has paused at the
rung, the best ceil(n / eta) go on to the next milestone (eta times further, at most max_t)
and the others stop (TERMINATED, `stopped_early`). A trial that reaches max_t stops.

Each step is recorded before it is applied, as population-based training's are:
1. **Pause.** Each trial's `RunConfig.stop` is a `HyperBandStopper`: at the first row at or
   past its rung's milestone it records the pause (`.unbroken/hyperband/paused/<trial>.json`:
   rung, time, value) and stops the trial; the sweep driver marks it PAUSED.
2. **Decide.** The sweep driver decides a bracket's rung once, from the values of that rung's
   pauses (`decisions/<bracket>-<rung>.json`: who goes on, who stops), so a restored sweep
   applies the decision an earlier driver made.
3. **Apply.** A trial that goes on gets `state/<trial>.json` (its next rung) and runs again:
   its run continues from its newest checkpoint, as a new attempt. One that stops is
   TERMINATED.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from unbroken.core.config import stop_due_at, stop_met, stop_met_at_resume
from unbroken.store import manifest as mf
from unbroken.store import sweep_manifest as sw
from unbroken.store.manifest import META_DIR
from unbroken.store.storage import Storage
from unbroken.tune.records import finite_number, last_kept_row, read_record

HB_DIR = f"{META_DIR}/hyperband"


@dataclass
class HyperBandScheduler:
    """Ray's synchronous HyperBand: `time_attr`, `metric`, `mode`, `max_t` (81),
    `reduction_factor` (3), `stop_last_trials` (True: a trial stops at max_t)."""

    time_attr: str = "training_iteration"
    metric: str | None = None
    mode: str | None = None
    max_t: float = 81
    reduction_factor: float = 3
    stop_last_trials: bool = True

    def __post_init__(self) -> None:
        if self.mode not in (None, "min", "max"):
            raise ValueError(f"HyperBandScheduler mode must be 'min' or 'max', got {self.mode!r}")
        if not self.max_t > 0 or not self.reduction_factor > 1:
            raise ValueError("HyperBandScheduler needs max_t > 0 and reduction_factor > 1, got "
                             f"max_t={self.max_t!r}, reduction_factor={self.reduction_factor!r}")

    def describe(self) -> dict[str, Any]:
        return {"kind": "hyperband", **asdict(self)}

    @property
    def brackets_per_band(self) -> int:
        return int(round(math.log(self.max_t) / math.log(self.reduction_factor))) + 1

    def size(self, s: int) -> int:
        """n0: how many trials bracket s holds."""
        eta = self.reduction_factor
        return int(math.ceil(self.brackets_per_band / (s + 1) * eta ** s))

    def bracket_of(self, index: int) -> tuple[int, int, range]:
        """Trial `index`'s bracket: (its number, its s, the trial indices it holds)."""
        sizes = [(s, self.size(s)) for s in reversed(range(self.brackets_per_band))]
        per_band = sum(n for _, n in sizes)
        band, offset = divmod(index, per_band)
        start = band * per_band
        for k, (s, n) in enumerate(sizes):
            if offset < n:
                return band * len(sizes) + k, s, range(start, start + n)
            offset, start = offset - n, start + n
        raise AssertionError("unreachable")

    def milestone(self, s: int, rung: int) -> float:
        """Rung `rung` of bracket s: r0 * eta**rung, at most max_t."""
        return min(self.max_t * self.reduction_factor ** (rung - s), self.max_t)

    def survivors(self, s: int, rung: int) -> int:
        """How many trials of bracket s go on past rung `rung`."""
        n = self.size(s)
        for _ in range(rung + 1):
            n = int(math.ceil(n / self.reduction_factor))
        return n


def rung_of(storage: Storage, trial: str) -> int:
    """The rung the trial runs towards now."""
    return (read_record(storage, f"{HB_DIR}/state/{trial}.json") or {"rung": 0})["rung"]


def pending(storage: Storage, trial: str) -> dict[str, Any] | None:
    """The trial's pause that no decision has handled yet, if any."""
    paused = read_record(storage, f"{HB_DIR}/paused/{trial}.json")
    return paused if paused is not None and paused["rung"] >= rung_of(storage, trial) else None


def stopped(storage: Storage, trial: str) -> dict[str, Any] | None:
    """Why the trial was stopped at a rung, if it was."""
    return read_record(storage, f"{HB_DIR}/stopped/{trial}.json")


def finished_status(storage: Storage, trial: str, run: Any) -> str:
    """The sweep status of a trial whose run is FINISHED: PAUSED with a pause to decide,
    PENDING when a decision let it go on after its last attempt began, else TERMINATED."""
    if pending(storage, trial) is not None:
        return sw.PAUSED
    handled = (read_record(storage, f"{HB_DIR}/state/{trial}.json") or {}).get("handled_at")
    if stopped(storage, trial) is None and handled is not None and run.attempts and \
            run.attempts[-1].started_at < handled:
        return sw.PENDING
    return sw.TERMINATED


def describe_stop(decision: dict[str, Any]) -> str:
    return (f"HyperBand: {decision['metric']}={decision['value']:.6g} not among the best {decision['kept']} "
            f"of bracket {decision['bracket']} at {decision['time_attr']}={decision['milestone']:g}")


class HyperBandStopper:
    """The `RunConfig.stop` of one trial: its own stop condition, max_t, then its pause at its
    rung's milestone (see the module docstring)."""

    def __init__(self, trial: str, index: int, sweep_url: str, storage_filesystem: Any,
                 scheduler: HyperBandScheduler, metric: str | None, user_stop: Any = None) -> None:
        self.trial, self.index, self.sweep_url = trial, index, sweep_url
        self.storage_filesystem, self.scheduler, self.metric, self.user_stop = (
            storage_filesystem, scheduler, metric, user_stop)
        self._rung: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_rung": None}

    def _milestone(self) -> float:
        if self._rung is None:
            self._rung = rung_of(Storage.from_url(self.sweep_url, self.storage_filesystem), self.trial)
        return self.scheduler.milestone(self.scheduler.bracket_of(self.index)[1], self._rung)

    def verdict_from(self) -> int | None:
        """The iteration of the next milestone (a rank waits there for the pause, see
        `config.stop_due_at`), or the user's stop when it comes first."""
        user = stop_due_at(self.user_stop)
        if self.scheduler.time_attr != "training_iteration":
            return user
        ours = math.ceil(self._milestone())
        return ours if user is None else min(ours, user)

    def met_at_resume(self, row: dict[str, Any]) -> bool:
        t = row.get(self.scheduler.time_attr)
        last = self.scheduler.stop_last_trials and finite_number(t) and t >= self.scheduler.max_t
        return stop_met_at_resume(self.user_stop, row) or bool(last)

    def __call__(self, row: dict[str, Any]) -> bool:
        if stop_met(self.user_stop, row):
            return True
        t = row.get(self.scheduler.time_attr)
        if not finite_number(t):
            return False
        if t >= self.scheduler.max_t:
            return self.scheduler.stop_last_trials
        if t < self._milestone():
            return False
        record_pause(Storage.from_url(self.sweep_url, self.storage_filesystem), self.trial, self._rung or 0,
                     row, self.metric, t)
        return True


def record_pause(storage: Storage, trial: str, rung: int, row: dict[str, Any], metric: str | None,
                 t: float) -> None:
    value = row.get(metric) if metric else None
    storage.makedirs(f"{HB_DIR}/paused")
    storage.write_json(f"{HB_DIR}/paused/{trial}.json", {
        "rung": rung, "t": t, "value": value if finite_number(value) else None,
        "iteration": row.get("training_iteration")})


class Bands:
    """The sweep driver's side of HyperBand: decisions and their application (the module
    docstring). `records()`: the sweep's trial records, in index order."""

    def __init__(self, storage: Storage, scheduler: HyperBandScheduler, metric: str, mode: str,
                 records: Callable[[], list[sw.TrialRecord]]) -> None:
        self.storage, self.scheduler, self.metric, self.mode, self.records = (
            storage, scheduler, metric, mode, records)

    def _index(self, trial: str) -> int:
        return next(r.index for r in self.records() if r.name == trial)

    def trial_stopper(self, stop: Any, metric: str | None) -> HyperBandStopper:
        return HyperBandStopper(stop.trial, self._index(stop.trial), stop.sweep_url, stop.storage_filesystem,
                                self.scheduler, metric, stop)

    def pending(self, trial: str) -> dict[str, Any] | None:
        return pending(self.storage, trial)

    def overrides(self, trial: str) -> dict[str, Any]:
        return {}

    def catch_up(self, trial: str, user_stop: Any = None) -> None:
        """A trial whose driver died after recording the row at its milestone and before the
        pause: record the pause now (as `population.Population.catch_up` does), unless the
        row's checkpoint did not commit: then the trial redoes the row, and pauses then."""
        run = self.storage.child(trial)
        if self.pending(trial) is not None or stopped(self.storage, trial) or not mf.is_run_dir(run):
            return
        last = last_kept_row(run)
        t = last.get(self.scheduler.time_attr)
        s, rung = self.scheduler.bracket_of(self._index(trial))[1], rung_of(self.storage, trial)
        if finite_number(t) and self.scheduler.milestone(s, rung) <= t < self.scheduler.max_t and \
                not stop_met(user_stop, last):
            record_pause(self.storage, trial, rung, last, self.metric, t)

    def ready(self, trial: str, unfinished: list[str]) -> bool:
        """Whether every unfinished trial of the paused trial's bracket has paused at its rung."""
        paused = self.pending(trial)
        if paused is None:
            return True
        members = self._members(trial)
        return all(name not in unfinished or (self.pending(name) or {"rung": -1})["rung"] >= paused["rung"]
                   for name in members)

    def _members(self, trial: str) -> list[str]:
        indices = self.scheduler.bracket_of(self._index(trial))[2]
        return [r.name for r in self.records() if r.index in indices]

    def decide(self, trial: str) -> dict[str, Any]:
        """Decide the rung of the trial's bracket (or read the decision made before) and apply
        it to this trial: {"action": "continue"} or {"action": "stop", "why": ...}."""
        paused = self.pending(trial)
        assert paused is not None, trial
        number, s, _ = self.scheduler.bracket_of(self._index(trial))
        rel = f"{HB_DIR}/decisions/{number}-{paused['rung']}.json"
        decision = read_record(self.storage, rel)
        if decision is None:
            decision = self._choose(trial, number, s, paused["rung"])
            self.storage.makedirs(f"{HB_DIR}/decisions")
            self.storage.write_json(rel, decision)
        if trial not in decision["keep"]:
            value = paused["value"] if paused["value"] is not None else math.nan
            why = {"metric": self.metric, "value": value,
                   "kept": len(decision["keep"]), "bracket": number, "milestone": decision["milestone"],
                   "time_attr": self.scheduler.time_attr}
            self.storage.makedirs(f"{HB_DIR}/stopped")
            self.storage.write_json(f"{HB_DIR}/stopped/{trial}.json", why)
            return {"action": "stop", "why": describe_stop(why)}
        self.storage.makedirs(f"{HB_DIR}/state")
        self.storage.write_json(f"{HB_DIR}/state/{trial}.json", {"rung": paused["rung"] + 1,
                                                                  "handled_at": time.time()})
        return {"action": "continue"}

    def _choose(self, trial: str, number: int, s: int, rung: int) -> dict[str, Any]:
        values = {}
        for name in self._members(trial):
            paused = self.pending(name)
            if paused is not None and paused["rung"] == rung:
                value = paused["value"]
                values[name] = (-math.inf if value is None else value if self.mode == "max" else -value)
        ranked = sorted(values, key=lambda name: (values[name], name), reverse=True)
        keep = ranked[:self.scheduler.survivors(s, rung)]
        return {"bracket": number, "rung": rung, "milestone": self.scheduler.milestone(s, rung),
                "keep": sorted(keep), "values": values}

    def forget(self, trial: str) -> None:
        for rel in (f"{HB_DIR}/paused/{trial}.json", f"{HB_DIR}/state/{trial}.json",
                    f"{HB_DIR}/stopped/{trial}.json"):
            self.storage.remove(rel)
