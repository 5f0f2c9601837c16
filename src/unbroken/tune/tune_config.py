"""TuneConfig: how a sweep searches (Ray Tune's names and defaults)."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal


@dataclass
class TuneConfig:
    """How many trials a sweep runs, how they are proposed and scheduled, and which metric
    ranks them.

    - `num_samples`: how many times the param_space is sampled; a param_space with grid
      searches is repeated `num_samples` times, as in Ray Tune.
    - `max_concurrent_trials`: at most this many trials run at once (also bounded by the
      CPUs of this machine and the CPUs one trial uses).
    - `search_alg`: None (random and grid search), `BasicVariantGenerator(random_state=...)`
      or `OptunaSearch(...)` from `unbroken.tune.search`.
    - `scheduler`: None (every trial runs to its end) or `ASHAScheduler(...)` from
      `unbroken.tune.schedulers`.
    - `time_budget_s`: the sweep ends once sweep drivers have run it this many seconds (all
      fit() calls together; a number or a timedelta): running trials stop at their next
      report, and no trial starts after (see `unbroken.tune.sweep_stop`).
    - `trial_name_creator`, `trial_dirname_creator`: functions of a `tune.Callback`'s
      `Trial` view (id and config) that name a new trial (what `get_trial_name()` returns in
      it) and its directory under the sweep (see `unbroken.tune.trial_naming`).
    - `reuse_actors`: True: a trial's process (its driver and its worker processes) that ends
      its trial cleanly runs the next trial to start (a paused trial going on, or another
      one) instead of a new process, with what it imported and set up. A class trainable's
      object goes on too: `reset_config(new_config)` when the trial resumes from a
      checkpoint (then `load_checkpoint`), a new object otherwise or when it returns False.
      Trials on this machine only (each trial's actor on a Ray cluster runs one trial).
      None or False (the default, as in Ray): each trial's run starts new processes.
    - `seed`: the seed of random search (and of Optuna's default sampler). None: a random
      seed is drawn when the sweep starts and stored with it, so a restored sweep proposes
      what the uninterrupted one would have.
    """

    metric: str | None = None
    mode: Literal["min", "max"] | None = None
    search_alg: Any = None
    scheduler: Any = None
    num_samples: int = 1
    max_concurrent_trials: int | None = None
    seed: int | None = None
    time_budget_s: float | datetime.timedelta | None = None
    trial_name_creator: Callable[[Any], str] | None = None
    trial_dirname_creator: Callable[[Any], str] | None = None
    reuse_actors: bool | None = None

    def __post_init__(self) -> None:
        if self.reuse_actors is not None and not isinstance(self.reuse_actors, bool):
            raise ValueError(f"TuneConfig.reuse_actors must be None, True or False, got "
                             f"{self.reuse_actors!r}")
        if isinstance(self.time_budget_s, datetime.timedelta):
            self.time_budget_s = self.time_budget_s.total_seconds()
        budget = self.time_budget_s
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                                   or not budget > 0):
            raise ValueError(f"TuneConfig.time_budget_s must be None or a positive number of seconds, got "
                             f"{budget!r}")
        if self.mode not in (None, "min", "max"):
            raise ValueError(f"TuneConfig.mode must be 'min' or 'max', got {self.mode!r}")
        n = self.num_samples
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"TuneConfig.num_samples must be an int >= 1, got {self.num_samples!r}")
        if self.max_concurrent_trials is not None and (
                not isinstance(self.max_concurrent_trials, int) or self.max_concurrent_trials < 1):
            raise ValueError("TuneConfig.max_concurrent_trials must be None or an int >= 1, got "
                             f"{self.max_concurrent_trials!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"TuneConfig.seed must be None or an int, got {self.seed!r}")
        for creator in ("trial_name_creator", "trial_dirname_creator"):
            if getattr(self, creator) is not None and not callable(getattr(self, creator)):
                raise ValueError(f"TuneConfig.{creator} must be a function of the trial, got "
                                 f"{getattr(self, creator)!r}")
        if self.metric is not None and not isinstance(self.metric, str):
            raise ValueError(f"TuneConfig.metric must be a metric name, got {self.metric!r}")
