"""ASHA early stopping (asynchronous successive halving), with its decisions on disk.

`ASHAScheduler` holds the settings (Ray Tune's names). The decisions are made by
`TrialStopper`, which is the `RunConfig.stop` of each trial: the trial's driver calls it on
every metric row, as it does any stop condition. When a trial's `time_attr` reaches a rung
(grace_period * reduction_factor**k) it has not been judged at, the stopper records the
trial's value at that rung and stops the trial if the value is below the rung's cutoff, the
(1 - 1/reduction_factor) quantile of the values recorded there before it. A trial that
reaches max_t stops too. This is Ray's ASHA. With `brackets=N`, bracket s has its first rung
at grace_period * reduction_factor**s, and each trial runs in one bracket, judged against
the trials of that bracket only; the bracket is drawn as Ray draws it (a bracket with more
rungs is likelier), from a generator seeded by the trial's name, so that every driver of the
sweep, and every restore, puts a trial in the same bracket.

Several trial drivers write at once, so every record is a file of its own:
`<sweep>/.unbroken/asha/rung_<milestone>/<trial>.json` (bracket 0; bracket s > 0 under
`asha/bracket_<s>/`), and a stop decision is
`<sweep>/.unbroken/asha/stopped/<trial>.json`. The read-decide-write step holds the sweep's
ASHA lock (`asha/lock`: a file lock on local disks, a conditionally created object on object
stores; see `store.storage_lock`), so each decision is a function of the records that were
there at that moment, wherever the trials' drivers run. A trial resumed after a restore is
not judged again at rungs it was recorded at, and a trial with a stop decision stays stopped.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import zlib
from dataclasses import asdict, dataclass
from typing import Any

from unbroken.core.config import stop_due_at, stop_met, stop_met_at_resume
from unbroken.store import storage_lock
from unbroken.store.manifest import META_DIR
from unbroken.store.storage import Storage
from unbroken.tune.records import finite_number

ASHA_DIR = f"{META_DIR}/asha"
STOPPED_DIR = f"{ASHA_DIR}/stopped"


@dataclass
class ASHAScheduler:
    """Stop trials whose `metric` at a rung is below the rung's cutoff.

    `time_attr`: the row field that measures progress (default `training_iteration`);
    `metric`/`mode` default to TuneConfig's; `max_t`: every trial stops there;
    `grace_period`: the first rung; `reduction_factor`: rungs are grace_period *
    reduction_factor**k and roughly 1/reduction_factor of the trials pass each one;
    `brackets`: how many brackets, each starting one rung higher (see the module docstring).
    """

    time_attr: str = "training_iteration"
    metric: str | None = None
    mode: str | None = None
    max_t: float = 100
    grace_period: float = 1
    reduction_factor: float = 4
    brackets: int = 1

    def __post_init__(self) -> None:
        if self.mode not in (None, "min", "max"):
            raise ValueError(f"ASHAScheduler mode must be 'min' or 'max', got {self.mode!r}")
        if not self.max_t > 0 or not self.grace_period > 0:
            raise ValueError("ASHAScheduler needs max_t > 0 and grace_period > 0, got "
                             f"max_t={self.max_t!r}, grace_period={self.grace_period!r}")
        if self.grace_period > self.max_t:
            raise ValueError(f"ASHAScheduler grace_period ({self.grace_period}) must not exceed max_t "
                             f"({self.max_t})")
        if not self.reduction_factor > 1:
            raise ValueError(f"ASHAScheduler reduction_factor must be > 1, got {self.reduction_factor!r}")
        if isinstance(self.brackets, bool) or not isinstance(self.brackets, int) or self.brackets < 1:
            raise ValueError(f"ASHAScheduler brackets must be an int >= 1, got {self.brackets!r}")

    def milestones(self, bracket: int = 0) -> list[float]:
        """The rungs of `bracket`, lowest first (Ray's: every grace_period * rf**(k + bracket)
        up to max_t)."""
        out, m = [], self.grace_period * self.reduction_factor ** bracket
        while m <= self.max_t * (1 + 1e-9):
            out.append(m)
            m *= self.reduction_factor
        return out

    def bracket_of(self, trial: str) -> int:
        """The bracket `trial` runs in: bracket s with a probability proportional to
        e**(its rungs - the most rungs of any bracket), as in Ray, drawn from the trial's name."""
        if self.brackets == 1:
            return 0
        sizes = [len(self.milestones(s)) for s in range(self.brackets)]
        weights = [math.exp(n - max(sizes)) for n in sizes]
        return random.Random(zlib.crc32(trial.encode())).choices(range(self.brackets), weights)[0]

    def describe(self) -> dict[str, Any]:
        return {"kind": "asha", **asdict(self)}


def _rung_dir(milestone: float, bracket: int = 0) -> str:
    return f"{ASHA_DIR}/bracket_{bracket}/rung_{milestone:g}" if bracket else f"{ASHA_DIR}/rung_{milestone:g}"


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation (numpy's default), NaNs ignored."""
    s = sorted(v for v in values if not math.isnan(v))
    k = (len(s) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def read_decision(storage: Storage, trial: str) -> dict[str, Any] | None:
    """The stop decision recorded for `trial`, if any."""
    try:
        return json.loads(storage.read_bytes(f"{STOPPED_DIR}/{trial}.json"))
    except (FileNotFoundError, ValueError):
        return None


def describe_decision(decision: dict[str, Any]) -> str:
    """Why a trial was stopped, in the metric's own terms: below the cutoff for mode="max",
    above it for mode="min"."""
    side = "above" if decision["value"] > decision["cutoff"] else "below"
    bracket = f" of bracket {decision['bracket']}" if decision.get("bracket") else ""
    return (f"ASHA: {decision['metric']}={decision['value']:.6g} {side} the cutoff {decision['cutoff']:.6g} "
            f"of rung {decision['rung']:g}{bracket} ({decision['time_attr']}={decision['time']:g})")


def forget_trial(storage: Storage, trial: str) -> None:
    """Remove a trial's rung records and stop decision (it is restarted from scratch)."""
    for name in storage.listdir(ASHA_DIR):
        if name.startswith("rung_"):
            storage.remove(f"{ASHA_DIR}/{name}/{trial}.json")
        elif name.startswith("bracket_"):
            for rung in storage.listdir(f"{ASHA_DIR}/{name}"):
                storage.remove(f"{ASHA_DIR}/{name}/{rung}/{trial}.json")
    storage.remove(f"{STOPPED_DIR}/{trial}.json")


class TrialStopper:
    """The `RunConfig.stop` of one trial: its own stop condition, then the scheduler's."""

    def __init__(self, trial: str, sweep_url: str, storage_filesystem: Any, scheduler: ASHAScheduler | None,
                 metric: str | None, mode: str | None, user_stop: Any = None) -> None:
        self.trial = trial
        self.sweep_url = sweep_url
        self.storage_filesystem = storage_filesystem
        self.scheduler = scheduler
        self.metric = metric
        self.mode = mode
        self.user_stop = user_stop
        self._storage: Storage | None = None
        self._recorded: set[float] = set()
        self._stopped: bool | None = None
        self._last_t = 0.0  # the time of the latest row seen

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_storage=None, _recorded=set(), _stopped=None, _last_t=0.0)
        return state

    def __repr__(self) -> str:
        return (f"TrialStopper(trial={self.trial!r}, scheduler={self.scheduler!r}, "
                f"user_stop={self.user_stop!r})")

    @property
    def storage(self) -> Storage:
        if self._storage is None:
            self._storage = Storage.from_url(self.sweep_url, self.storage_filesystem)
        return self._storage

    def verdict_from(self) -> int | None:
        """The iteration of the next rung not judged yet (or max_t), when the time is counted in
        iterations: a rank waits there for the verdict instead of running one more iteration
        (see `config.stop_due_at`); the user's own stop, if it says, when it comes first."""
        user = stop_due_at(self.user_stop)
        sched = self.scheduler
        if sched is None or sched.time_attr != "training_iteration":
            return user
        rungs = [m for m in sched.milestones(sched.bracket_of(self.trial))
                 if m not in self._recorded and m > self._last_t]
        ours = math.ceil(min(rungs + [sched.max_t]))
        return ours if user is None else min(ours, user)

    def met_at_resume(self, row: dict[str, Any]) -> bool:
        """The trial's own stop at the row it resumes from, or a stop decision recorded for it
        (it was stopped there), or max_t reached."""
        if stop_met_at_resume(self.user_stop, row):
            return True
        if self.scheduler is None:
            return False
        t = row.get(self.scheduler.time_attr)
        reached = finite_number(t) and t >= self.scheduler.max_t
        return reached or read_decision(self.storage, self.trial) is not None

    def __call__(self, row: dict[str, Any]) -> bool:
        if stop_met(self.user_stop, row):
            return True
        if self.scheduler is None:
            return False
        return self._asha(row)

    def _asha(self, row: dict[str, Any]) -> bool:
        sched = self.scheduler
        t, value = row.get(sched.time_attr), row.get(self.metric)
        if finite_number(t):
            self._last_t = max(self._last_t, t)
        if not finite_number(t) or not finite_number(value):
            return False  # rows without the metric are not judged (as in Ray)
        if self._stopped is None:
            self._stopped = read_decision(self.storage, self.trial) is not None
        if self._stopped:
            return True
        if t >= sched.max_t:
            return True
        reward = value if self.mode == "max" else -value
        for milestone in reversed(sched.milestones(sched.bracket_of(self.trial))):
            if t < milestone or milestone in self._recorded:
                continue
            stop = self._judge(milestone, t, value, reward)
            self._recorded.add(milestone)
            if stop is None:
                continue  # recorded at this rung by an earlier attempt
            self._stopped = stop
            return stop
        return False

    def _judge(self, milestone: float, t: float, value: float, reward: float) -> bool | None:
        """Record this trial at `milestone` and decide; None if it was recorded there already."""
        bracket = self.scheduler.bracket_of(self.trial)
        storage, rung = self.storage, _rung_dir(milestone, bracket)
        mine = f"{rung}/{self.trial}.json"
        with self._lock():
            if storage.exists(mine):
                return None
            others = []
            for name in storage.listdir(rung):
                if name.endswith(".json") and name != f"{self.trial}.json":
                    try:
                        others.append(float(json.loads(storage.read_bytes(f"{rung}/{name}"))["reward"]))
                    except (FileNotFoundError, ValueError, KeyError, TypeError):
                        continue
            others = [r for r in others if not math.isnan(r)]
            rf = self.scheduler.reduction_factor
            cutoff = percentile(others, (1 - 1 / rf) * 100) if others else None
            stop = cutoff is not None and reward < cutoff
            storage.makedirs(rung)
            if stop:
                storage.makedirs(STOPPED_DIR)
                storage.write_json(f"{STOPPED_DIR}/{self.trial}.json", {
                    "rung": milestone, "time": t, "time_attr": self.scheduler.time_attr,
                    "metric": self.metric, "value": value,
                    "cutoff": cutoff if self.mode == "max" else -cutoff, "reward": reward,
                    "bracket": bracket})
            storage.write_json(mine, {"reward": reward, "value": value, "time": t})
            return stop

    def _lock(self) -> contextlib.AbstractContextManager[None]:
        return storage_lock.held(self.storage, f"{ASHA_DIR}/lock")
