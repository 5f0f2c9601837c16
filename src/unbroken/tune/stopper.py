"""Stoppers (Ray Tune's `ray.tune.stopper`): `RunConfig(stop=...)` objects that end trials, or
the whole sweep.

A stopper is asked twice over, as Ray asks it:

- `stopper(trial_id, result)`: whether this trial stops at this result. Each trial asks its
  own copy, in its own driver, on its own rows, at the report itself, so a trial stops at the
  same row whatever the timing. After a restore or a retry the copy is rebuilt from the
  trial's history (`sweep_stop.TrialStop`), so it decides as the copy of an uninterrupted
  trial would.
- `stopper.stop_all()`: whether the whole sweep ends. The sweep driver asks a copy that it
  feeds every row of every trial, in the order it reads them (replayed from the trials'
  histories after a restore). Once it says yes, no trial starts, the running ones stop at
  their next report, and a restore runs nothing more.

`TimeoutStopper` counts the time sweep drivers were running the sweep, all fit() calls
together: the time between a killed driver and its restore is not spent.
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any


class Stopper:
    """Base class of stoppers: override `__call__` (one trial) and `stop_all` (the sweep)."""

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        """Whether trial `trial_id` stops at `result` (a metric row)."""
        raise NotImplementedError

    def stop_all(self) -> bool:
        """Whether the whole sweep stops now."""
        raise NotImplementedError


class NoopStopper(Stopper):
    """Stops nothing."""

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        return False

    def stop_all(self) -> bool:
        return False


class CombinedStopper(Stopper):
    """Stops a trial, or the sweep, when any of `stoppers` does (each is asked every time)."""

    def __init__(self, *stoppers: Stopper) -> None:
        self._stoppers = list(stoppers)

    @property
    def stoppers(self) -> list[Stopper]:
        return list(self._stoppers)

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        return any([s(trial_id, result) for s in self._stoppers])  # a list: every one is asked

    def stop_all(self) -> bool:
        return any([s.stop_all() for s in self._stoppers])


class FunctionStopper(Stopper):
    """A function `fn(trial_id, result) -> bool` as a stopper (it never stops the sweep)."""

    def __init__(self, function: Callable[[str, dict[str, Any]], bool]) -> None:
        self._fn = function

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        return bool(self._fn(trial_id, result))

    def stop_all(self) -> bool:
        return False

    @classmethod
    def is_valid_function(cls, fn: Any) -> bool:
        """Whether `fn` can be a stop function (callable, and not a Stopper already)."""
        return callable(fn) and not isinstance(fn, Stopper)


class MaximumIterationStopper(Stopper):
    """Stops each trial at its `max_iter`-th result."""

    def __init__(self, max_iter: int) -> None:
        self._max_iter = max_iter
        self._iter: dict[str, int] = defaultdict(int)

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        self._iter[trial_id] += 1
        return self._iter[trial_id] >= self._max_iter

    def stop_all(self) -> bool:
        return False


class TrialPlateauStopper(Stopper):
    """Stops a trial whose `metric` has plateaued: the population standard deviation of its
    last `num_results` values is below `std`, once it has reported `grace_period` results
    and, with `metric_threshold`, its value is at least that good (`mode` says which way)."""

    def __init__(self, metric: str, std: float = 0.01, num_results: int = 4, grace_period: int = 4,
                 metric_threshold: float | None = None, mode: str | None = None) -> None:
        if metric_threshold is not None and mode not in ("min", "max"):
            raise ValueError("TrialPlateauStopper with a metric_threshold needs mode='min' or 'max', "
                             f"got {mode!r}")
        self._metric, self._std, self._num_results = metric, std, num_results
        self._grace_period, self._metric_threshold, self._mode = grace_period, metric_threshold, mode
        self._results: dict[str, deque] = defaultdict(lambda: deque(maxlen=num_results))
        self._iter: dict[str, int] = defaultdict(int)

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        value = result.get(self._metric)
        window = self._results[trial_id]
        window.append(value)
        self._iter[trial_id] += 1
        if self._iter[trial_id] < self._grace_period or len(window) < self._num_results:
            return False
        if self._metric_threshold is not None and (
                (self._mode == "min" and value > self._metric_threshold)
                or (self._mode == "max" and value < self._metric_threshold)):
            return False
        try:
            spread = statistics.pstdev(window)
        except (TypeError, ValueError):  # a missing or non-numeric value in the window
            return False
        return spread < self._std

    def stop_all(self) -> bool:
        return False


class ExperimentPlateauStopper(Stopper):
    """Stops the sweep once the `top` best values of `metric` over every trial's results have
    a standard deviation of at most `std`, for `patience` results in a row.

    It decides for the sweep only: asked for one trial, it answers no (the sweep driver's
    copy, which sees every trial's results, ends them all when it says so)."""

    def __init__(self, metric: str, std: float = 0.001, top: int = 10, mode: str = "min",
                 patience: int = 0) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"ExperimentPlateauStopper mode must be 'min' or 'max', got {mode!r}")
        if not isinstance(top, int) or top < 2:
            raise ValueError(f"ExperimentPlateauStopper top must be an int >= 2, got {top!r}")
        self._metric, self._std, self._top, self._mode, self._patience = metric, std, top, mode, patience
        self._top_values: list[float] = []
        self._plateaued_for = 0

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        value = result.get(self._metric)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            best = sorted([*self._top_values, value], reverse=self._mode == "max")
            self._top_values = best[:self._top]
        self._plateaued_for = self._plateaued_for + 1 if self._plateaued() else 0
        return False

    def _plateaued(self) -> bool:
        return len(self._top_values) == self._top and statistics.pstdev(self._top_values) <= self._std

    def stop_all(self) -> bool:
        return self._plateaued() and self._plateaued_for >= self._patience


class TimeoutStopper(Stopper):
    """Stops the sweep once it has run `timeout` (seconds or a timedelta): the time sweep
    drivers spent on it, all fit() calls together."""

    def __init__(self, timeout: float | datetime.timedelta) -> None:
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise ValueError(f"TimeoutStopper timeout must be a positive number of seconds or a "
                             f"timedelta, got {timeout!r}")
        self._budget = float(timeout)
        self._spent_before = 0.0
        self._since = time.monotonic()

    @property
    def budget_s(self) -> float:
        return self._budget

    def resume_clock(self, spent_s: float) -> None:
        """The sweep had run `spent_s` before now (set by the sweep driver at each fit())."""
        self._spent_before, self._since = spent_s, time.monotonic()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_since": None}  # a monotonic time means nothing elsewhere

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _since=time.monotonic())

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        return False

    def stop_all(self) -> bool:
        return self._spent_before + time.monotonic() - self._since >= self._budget


def walk(stopper: Any) -> list[Any]:
    """`stopper` and, inside CombinedStoppers, every stopper it combines."""
    if isinstance(stopper, CombinedStopper):
        return [stopper, *(s for child in stopper.stoppers for s in walk(child))]
    return [stopper]


__all__ = ["CombinedStopper", "ExperimentPlateauStopper", "FunctionStopper", "MaximumIterationStopper",
           "NoopStopper", "Stopper", "TimeoutStopper", "TrialPlateauStopper"]
