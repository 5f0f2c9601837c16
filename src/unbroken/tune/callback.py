"""Sweep callbacks (Ray Tune's `tune.Callback` and `tune.logger.LoggerCallback`), called by the
sweep driver, and their dispatch.

Given in the sweep's `RunConfig(callbacks=[...])` beside the run callbacks of
`unbroken.train` (those go to each trial's run). The hooks are Ray's, called with Ray's
keyword arguments: `iteration` counts the passes of the sweep driver's loop in this fit()
(Tune's controller steps); `trials` are the sweep's trials and `trial` the one concerned, as
`Trial` views (`trial_id`, `trial_name`, `config`, `status`, `last_result`, `path`, `error`).
A hook that raises is logged and the sweep goes on, as with run callbacks.

Exactly once across a killed sweep driver. The sweep manifest keeps, per trial, a mark of
the last event of each kind the callbacks were given (`TrialRecord.results_seen`,
`saves_seen`, `restores_seen`, `recovers_seen`, `end_due`), and every write of it also holds
each callback's `get_state()` (`callback_state`). A later fit() of the sweep gives each state
back (`set_state`, before `setup` and before anything is delivered) and goes on from the
marks. A driver killed between a delivery and the next write delivers it again, to a
callback restored to the state saved before it: what a callback keeps in its state counts
each event once; what it does elsewhere (a file it appends to) may see the last few twice.

- `setup`: at the start of every fit() of the sweep, a restored one too.
- `on_step_begin` / `on_step_end`: once per pass of the driver's loop; nothing is recorded.
- `on_trial_start`: each time a trial's driver is started (a resumed trial again); nothing is
  recorded: a restored sweep starts the trial again and says so again.
- `on_trial_result`: each iteration of the trial's history once, in order (`results_seen`).
- `on_checkpoint(checkpoint=...)`, then `on_trial_save`: once per checkpoint a row of the
  trial's history names, once it is known committed, after that row's result (`saves_seen`;
  see `trial_events`). A checkpoint saved just in time by a recovery names no row and is not
  reported.
- `on_trial_restore`: once per fit() of the trial's run that began from a committed checkpoint:
  a restored sweep, a relaunch, `resume_errored`, a paused trial going on, an exploit's clone
  of its donor's checkpoint (`restores_seen`).
- `on_trial_recover`: once per failed attempt of the trial's run that its `FailureConfig`
  retried (`recovers_seen`). Both come before the results of the attempt that followed.
- `on_trial_complete` / `on_trial_error`: once, when the trial is recorded TERMINATED or ERROR,
  after everything else of it (`end_due`), also for a trial that ended while no driver ran.
- `on_experiment_end`: at the end of every fit() that was not killed.
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
    trainable_name: str = ""  # the trainable's name: a function's, or a class's

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
        """A pass of the sweep driver's loop begins (`iteration` passes ended before it)."""

    def on_step_end(self, iteration: int, trials: list[Trial], **info: Any) -> None:
        """A pass of the sweep driver's loop ended (`iteration` counts it)."""

    def on_trial_start(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        """A trial's driver was started (a resumed trial too)."""

    def on_trial_restore(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        """A trial's run began again from a committed checkpoint (its own, or a donor's)."""

    def on_trial_save(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        """A trial's checkpoint committed (after `on_checkpoint`)."""

    def on_trial_result(self, iteration: int, trials: list[Trial], trial: Trial, result: dict[str, Any],
                        **info: Any) -> None:
        """A trial reported `result` (one row of its history)."""

    def on_trial_complete(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        """A trial ended TERMINATED (its results were all delivered first)."""

    def on_trial_recover(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        """An attempt of a trial's run failed, and its FailureConfig runs another."""

    def on_trial_error(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        """A trial ended in ERROR (`trial.error` says why)."""

    def on_checkpoint(self, iteration: int, trials: list[Trial], trial: Trial, checkpoint: Any,
                      **info: Any) -> None:
        """A trial's checkpoint committed: `checkpoint` is it, in the trial's run directory."""

    def on_experiment_end(self, trials: list[Trial], **info: Any) -> None:
        """The sweep's fit() ends (every trial done, or the sweep ended or interrupted)."""

    def get_state(self) -> Any:
        """What to save of this callback with the sweep, or None (nothing). Plain data (dicts,
        lists, numbers, strings) is stored as JSON; anything else is pickled."""
        return None

    def set_state(self, state: Any) -> None:
        """Take back what `get_state` returned, when a later fit() of the sweep begins."""


class LoggerCallback(Callback):
    """Ray's base class of logger callbacks: `log_trial_start`, `log_trial_result`,
    `log_trial_end(trial, failed)`."""

    def log_trial_start(self, trial: Trial) -> None:
        """A trial started."""

    def log_trial_result(self, iteration: int, trial: Trial, result: dict[str, Any]) -> None:
        """A trial reported a result."""

    def log_trial_end(self, trial: Trial, failed: bool = False) -> None:
        """A trial ended (`failed`: in ERROR)."""

    def log_trial_save(self, trial: Trial) -> None:
        """A trial's checkpoint committed."""

    def log_trial_restore(self, trial: Trial) -> None:
        """A trial began again from a checkpoint."""

    def on_trial_start(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        self.log_trial_start(trial)

    def on_trial_result(self, iteration: int, trials: list[Trial], trial: Trial, result: dict[str, Any],
                        **info: Any) -> None:
        self.log_trial_result(iteration, trial, result)

    def on_trial_complete(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        self.log_trial_end(trial, failed=False)

    def on_trial_error(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        self.log_trial_end(trial, failed=True)

    def on_trial_save(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        self.log_trial_save(trial)

    def on_trial_restore(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        self.log_trial_restore(trial)


# The log_trial_* method each LoggerCallback hook calls: the hook is wanted only where it is overridden.
_LOGGED = {"on_trial_start": "log_trial_start", "on_trial_result": "log_trial_result",
           "on_trial_complete": "log_trial_end", "on_trial_error": "log_trial_end",
           "on_trial_save": "log_trial_save", "on_trial_restore": "log_trial_restore"}


def overrides(callback: Callback, hook: str) -> bool:
    """Whether calling `hook` on `callback` can do anything (so that what only feeds a hook
    nobody overrides, such as reading the trials' checkpoints, is skipped)."""
    impl = getattr(type(callback), hook)
    if impl is getattr(Callback, hook):
        return False
    if isinstance(callback, LoggerCallback) and impl is getattr(LoggerCallback, hook):
        logged = _LOGGED[hook]
        return getattr(type(callback), logged) is not getattr(LoggerCallback, logged)
    return True


def split(callbacks: list[Any] | None) -> tuple[list[Callback], list[Any]]:
    """(the sweep callbacks, the run callbacks) of a RunConfig's list."""
    mine = [c for c in callbacks or [] if isinstance(c, Callback)]
    return mine, [c for c in callbacks or [] if not isinstance(c, Callback)]


class SweepCallbacks:
    """The sweep driver's dispatch to the sweep callbacks, in the order given."""

    def __init__(self, callbacks: list[Callback]) -> None:
        self.callbacks = callbacks
        self.iteration = 0  # passes of the sweep driver's loop ended in this fit()
        self._wanted: dict[str, bool] = {}

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def wants(self, *hooks: str) -> bool:
        """Whether some callback overrides one of `hooks`."""
        for hook in hooks:
            if hook not in self._wanted:
                self._wanted[hook] = any(overrides(c, hook) for c in self.callbacks)
        return any(self._wanted[hook] for hook in hooks)

    @property
    def wants_results(self) -> bool:
        return self.wants("on_trial_result")

    def call(self, hook: str, **kwargs: Any) -> None:
        """Call `hook` on each callback; one that raises is logged and the others still run."""
        for callback in self.callbacks:
            try:
                getattr(callback, hook)(**kwargs)
            except Exception as e:
                log.warning("sweep callback %s.%s raised %s: %s; the sweep goes on", type(callback).__name__,
                            hook, type(e).__name__, e)

    def trial_hook(self, hook: str, trials: list[Trial], trial: Trial, **kwargs: Any) -> None:
        """A trial's hook, with the current `iteration` and the sweep's trials."""
        self.call(hook, iteration=self.iteration, trials=trials, trial=trial, **kwargs)
