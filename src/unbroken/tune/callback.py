"""Sweep callbacks (Ray Tune's `tune.Callback` and `tune.logger.LoggerCallback`), called by the
sweep driver, and their dispatch.

Given in the sweep's `RunConfig(callbacks=[...])` beside the run callbacks of
`unbroken.train` (those go to each trial's run). The hooks are Ray's, with Ray's arguments:
`setup`, `on_trial_start`, `on_trial_result`, `on_trial_complete`, `on_trial_error`,
`on_experiment_end` (and `on_step_begin`/`on_step_end`, `on_trial_save`, `on_trial_restore`,
`on_trial_recover`, `on_checkpoint`, accepted and not called). `iteration` counts the sweep
driver's calls; `trials` are the sweep's trials and `trial` the one concerned, as `Trial`
views (`trial_id`, `trial_name`, `config`, `status`, `last_result`, `path`, `error`).

Results come from the trials' histories as the sweep driver reads them (`trial_rows`),
each iteration once, in each trial's order, before that trial's `on_trial_complete`. Across
a killed driver each result is delivered once: the sweep manifest records, per trial, the
last iteration delivered (`TrialRecord.results_seen`), and a restored driver goes on from
there. A callback that raises is logged and the sweep goes on, as with run callbacks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("unbroken")


@dataclass
class Trial:
    """What a callback is told about one trial (Ray's `Trial`: `str(trial)` is its name)."""

    trial_id: str
    trial_name: str
    config: dict[str, Any]
    status: str
    path: str
    last_result: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def local_path(self) -> str:
        return self.path

    logdir = local_path

    @property
    def experiment_tag(self) -> str:
        return self.trial_name

    def __str__(self) -> str:
        return self.trial_name


class Callback:
    """Subclass it and override the hooks you need (all do nothing here)."""

    def setup(self, stop: Any = None, num_samples: int | None = None, total_num_samples: int | None = None,
              **info: Any) -> None:
        """The sweep starts (each fit(), a restored one too)."""

    def on_step_begin(self, iteration: int, trials: list[Trial], **info: Any) -> None:
        """Accepted for Ray's scripts; the sweep driver has no steps to begin."""

    def on_step_end(self, iteration: int, trials: list[Trial], **info: Any) -> None:
        """Accepted for Ray's scripts; the sweep driver has no steps to end."""

    def on_trial_start(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        """A trial's driver was started (a resumed trial too)."""

    def on_trial_restore(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        """Accepted for Ray's scripts (a trial restores inside its own run)."""

    def on_trial_save(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        """Accepted for Ray's scripts (a trial's checkpoints commit inside its own run)."""

    def on_trial_result(self, iteration: int, trials: list[Trial], trial: Trial, result: dict[str, Any],
                        **info: Any) -> None:
        """A trial reported `result` (one row of its history)."""

    def on_trial_complete(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        """A trial ended TERMINATED (its results were all delivered first)."""

    def on_trial_recover(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        """Accepted for Ray's scripts (a trial recovers inside its own run)."""

    def on_trial_error(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        """A trial ended in ERROR (`trial.error` says why)."""

    def on_checkpoint(self, iteration: int, trials: list[Trial], trial: Trial, checkpoint: Any,
                      **info: Any) -> None:
        """Accepted for Ray's scripts (run callbacks' `on_checkpoint` sees each commit)."""

    def on_experiment_end(self, trials: list[Trial], **info: Any) -> None:
        """The sweep's fit() ends (every trial done, or the sweep ended or interrupted)."""


class LoggerCallback(Callback):
    """Ray's base class of logger callbacks: `log_trial_start`, `log_trial_result`,
    `log_trial_end(trial, failed)`."""

    def log_trial_start(self, trial: Trial) -> None:
        """A trial started."""

    def log_trial_result(self, iteration: int, trial: Trial, result: dict[str, Any]) -> None:
        """A trial reported a result."""

    def log_trial_end(self, trial: Trial, failed: bool = False) -> None:
        """A trial ended (`failed`: in ERROR)."""

    def on_trial_start(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        self.log_trial_start(trial)

    def on_trial_result(self, iteration: int, trials: list[Trial], trial: Trial, result: dict[str, Any],
                        **info: Any) -> None:
        self.log_trial_result(iteration, trial, result)

    def on_trial_complete(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        self.log_trial_end(trial, failed=False)

    def on_trial_error(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        self.log_trial_end(trial, failed=True)


def split(callbacks: list[Any] | None) -> tuple[list[Callback], list[Any]]:
    """(the sweep callbacks, the run callbacks) of a RunConfig's list."""
    mine = [c for c in callbacks or [] if isinstance(c, Callback)]
    return mine, [c for c in callbacks or [] if not isinstance(c, Callback)]


class SweepCallbacks:
    """The sweep driver's dispatch to the sweep callbacks, in the order given."""

    def __init__(self, callbacks: list[Callback]) -> None:
        self.callbacks = callbacks
        self.iteration = 0

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    @property
    def wants_results(self) -> bool:
        return any(type(c).on_trial_result is not Callback.on_trial_result for c in self.callbacks)

    def call(self, hook: str, *args: Any, **kwargs: Any) -> None:
        """Call `hook` on each callback; one that raises is logged and the others still run."""
        for callback in self.callbacks:
            try:
                getattr(callback, hook)(*args, **kwargs)
            except Exception as e:
                log.warning("sweep callback %s.%s raised %s: %s; the sweep goes on", type(callback).__name__,
                            hook, type(e).__name__, e)

    def trial_hook(self, hook: str, trials: list[Trial], trial: Trial, **kwargs: Any) -> None:
        """A trial's hook, with the next `iteration` and the sweep's trials."""
        self.iteration += 1
        self.call(hook, self.iteration, trials, trial, **kwargs)
