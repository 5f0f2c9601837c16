"""How Tune's stop conditions reach the trials: a stopper or `fn(trial_id, result)` asked for
each trial in its own driver (`TrialStop`), and the sweep's own end, by a stopper's
`stop_all()` or `TuneConfig(time_budget_s=...)`, decided by the sweep driver (`SweepWatch`).

A sweep that ends this way records why in its manifest (`SweepManifest.stopped`) and leaves a
marker file, `<sweep>/.unbroken/stopped.json`, that each trial's `TrialStop` looks for (once a
second at most): a running trial stops at its next report, with its checkpoint as at any stop,
and ends TERMINATED; no trial starts after it, in this fit() or a restored one.

Durable across a killed sweep driver: a trial's copy of the stopper is rebuilt, after a
restore or a retry, by asking a pristine copy about the trial's earlier rows (its history, each
iteration once), so it holds what the copy of an uninterrupted trial would. The sweep driver's
copy is rebuilt the same way from every trial's history, and the time budget counts the time
drivers spent on the sweep (`SweepManifest.running_s`), so the time between a killed driver
and its restore is not spent.
"""

from __future__ import annotations

import copy
import inspect
import json
import time
from typing import Any

from unbroken.core.config import stop_due_at, stop_met, stop_met_at_resume
from unbroken.store import history
from unbroken.store.manifest_base import META_DIR
from unbroken.store.storage import Storage
from unbroken.tune import asha
from unbroken.tune import stopper as st

STOPPED_MARKER = f"{META_DIR}/stopped.json"
MARKER_EVERY_S = 1.0  # how often a trial looks for the marker


def takes_trial_id(fn: Any) -> bool:
    """Whether a stop function is called as Tune calls it, `fn(trial_id, result)` (two
    positional parameters), rather than `fn(result)`."""
    if isinstance(fn, st.Stopper):
        return True
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


def needs_wrapping(stop: Any, time_budget_s: float | None, fail_fast: Any) -> bool:
    """Whether a sweep's trials need a `TrialStop`: a stopper or `fn(trial_id, result)` to ask,
    or a sweep that can end before its trials do. Otherwise a trial's stop is the user's as it
    is (a dict or `fn(result)`, or None), which its run stores as plain data where it can."""
    return bool(time_budget_s is not None or fail_fast or isinstance(stop, st.Stopper)
                or (callable(stop) and takes_trial_id(stop)))


def ask(stop: Any, trial_id: str, row: dict[str, Any], with_id: bool) -> bool:
    """One verdict of a user's stop condition: a dict, `fn(result)`, or `fn(trial_id, result)`
    (`with_id`: `takes_trial_id(stop)`, worked out once per trial rather than per row)."""
    return bool(stop(trial_id, row)) if with_id else stop_met(stop, row)


class TrialStop:
    """The `RunConfig.stop` of one trial of a sweep: the user's stop condition for this trial
    (a dict, a function, a stopper), or yes once the sweep has ended."""

    def __init__(self, trial: str, trial_id: str, sweep_url: str, storage_filesystem: Any, stop: Any,
                 wrapped: bool = True) -> None:
        self.trial = trial
        self.wrapped = wrapped  # False: the trial needs only the user's stop (trial_stopper)
        self.trial_id = trial_id
        self.sweep_url = sweep_url
        self.storage_filesystem = storage_filesystem
        self.stop = stop
        self._with_id = callable(stop) and takes_trial_id(stop)
        self._live: Any = None  # the copy asked now, or None until rebuilt
        self._last: Any = None  # the last iteration it was asked about
        self._checked_at = -MARKER_EVERY_S

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_live": None, "_last": None, "_checked_at": -MARKER_EVERY_S}

    def __repr__(self) -> str:
        return f"TrialStop(trial={self.trial!r}, stop={self.stop!r})"

    def _sweep(self) -> Storage:
        return Storage.from_url(self.sweep_url, self.storage_filesystem)

    def __call__(self, row: dict[str, Any]) -> bool:
        if self._sweep_ended():
            return True
        if not isinstance(self.stop, st.Stopper):  # stateless: nothing to rebuild
            return ask(self.stop, self.trial_id, row, self._with_id)
        iteration = row.get("training_iteration")
        if self._live is None or (isinstance(iteration, int) and isinstance(self._last, int)
                                  and iteration <= self._last):
            self._rebuild(iteration)
        self._last = iteration
        return bool(self._live(self.trial_id, row))

    def verdict_from(self) -> int | None:
        """The user's stop's first iteration, where it says (a dict's `training_iteration`):
        a rank waits there for the verdict (see `config.stop_due_at`)."""
        return stop_due_at(self.stop)

    def met_at_resume(self, row: dict[str, Any]) -> bool:
        """Whether the trial had stopped at the row it resumes from: the sweep has ended, or the
        user's stop says so there (a stopper asked as its copy would have been)."""
        if self._sweep().exists(STOPPED_MARKER):
            return True
        if isinstance(self.stop, dict) or not callable(self.stop):
            return stop_met_at_resume(self.stop, row)
        return self(row)

    def _rebuild(self, iteration: Any) -> None:
        """A pristine copy of the stopper, asked about this trial's rows before `iteration`."""
        self._live = copy.deepcopy(self.stop)
        if not isinstance(iteration, int):
            return
        rows = history.timeline(history.read_rows(self._sweep().child(self.trial)))
        for row in rows:
            if isinstance(row.get("training_iteration"), int) and row["training_iteration"] < iteration:
                self._live(self.trial_id, row)

    def _sweep_ended(self) -> bool:
        now = time.monotonic()
        if now - self._checked_at < MARKER_EVERY_S:
            return False
        self._checked_at = now
        return self._sweep().exists(STOPPED_MARKER)


class SweepWatch:
    """The sweep driver's side: its copy of the user's stopper, fed every trial's rows, and
    the time budget. `check` says why the sweep ends now, or None."""

    def __init__(self, stop: Any, time_budget_s: float | None, spent_s: float) -> None:
        self.stop = stop if isinstance(stop, st.Stopper) else None
        self.budget = st.TimeoutStopper(time_budget_s) if time_budget_s is not None else None
        for s in [*st.walk(self.stop), self.budget]:
            if isinstance(s, st.TimeoutStopper):
                s.resume_clock(spent_s)
        #: Whether the stopper must see every trial's rows (its stop_all depends on them).
        self.feeds = self.stop is not None and any(
            type(s).stop_all is not _NEVER.get(type(s), None) for s in st.walk(self.stop))

    def check(self, rows: list[tuple[str, str, dict]]) -> str | None:
        """Feed the stopper new rows, (name, trial_id, row) oldest first, and say why the
        sweep ends now (None: it goes on)."""
        if self.feeds:
            for _, trial_id, row in rows:
                self.stop(trial_id, row)
        if self.stop is not None and self.stop.stop_all():
            return f"{type(self.stop).__name__}.stop_all()"
        if self.budget is not None and self.budget.stop_all():
            return f"time_budget_s={self.budget.budget_s:g}"
        return None


# The stoppers whose stop_all never says yes, or says so without being fed rows (the time).
_NEVER = {cls: cls.stop_all for cls in (st.NoopStopper, st.FunctionStopper, st.MaximumIterationStopper,
                                        st.TrialPlateauStopper, st.TimeoutStopper, st.CombinedStopper)}


def mark_stopped(storage: Storage, reason: str) -> None:
    """Leave the marker the running trials look for."""
    storage.makedirs(META_DIR)
    storage.write_atomic(STOPPED_MARKER, json.dumps({"reason": reason, "at": time.time()}).encode())


def unmark_stopped(storage: Storage) -> None:
    """Remove the marker: the sweep runs again (a restore that reruns errored trials)."""
    storage.remove(STOPPED_MARKER)


def user_stop(trainable: Any, run_config: Any) -> Any:
    """A sweep's trials' own stop condition: the sweep's RunConfig.stop, else the trainer's."""
    base = getattr(trainable, "run_config", None)
    return run_config.stop or (base.stop if base is not None else None)


def fail_fast(trainable: Any, run_config: Any) -> bool | str:
    """FailureConfig.fail_fast of the sweep's RunConfig, else of the trainer's."""
    base = getattr(trainable, "run_config", None)
    return run_config.failure_config.fail_fast or (base is not None and base.failure_config.fail_fast)


def trial_stopper(stop: TrialStop, population: Any, scheduler: Any, metric: str | None,
                  mode: str | None) -> Any:
    """The RunConfig.stop of a trial: its `TrialStop` (or the user's stop itself, when it
    needs none: `needs_wrapping`), inside the scheduler's stopper (the pause of PBT or
    HyperBand, `population`; ASHA's rungs) when the sweep has one."""
    if population is not None:
        return population.trial_stopper(stop, metric)
    if scheduler is not None:
        return asha.TrialStopper(stop.trial, stop.sweep_url, stop.storage_filesystem, scheduler, metric, mode,
                                 stop)
    return stop if stop.wrapped else stop.stop
