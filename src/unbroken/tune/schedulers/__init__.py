"""Trial schedulers for `TuneConfig(scheduler=...)` (Ray Tune's names).

- `FIFOScheduler()`: every trial runs to its end (the default).
- `ASHAScheduler(time_attr, metric, mode, max_t, grace_period, reduction_factor, brackets)`:
  early stopping by asynchronous successive halving, in one bracket or several (asynchronous
  HyperBand); `AsyncHyperBandScheduler` is the same class.
  Ray's module path works too: `unbroken.tune.schedulers.async_hyperband`.

- `HyperBandScheduler(time_attr, metric, mode, max_t, reduction_factor, stop_last_trials)`:
  synchronous HyperBand; each bracket's trials pause at a rung until all have reached it, and
  the best go on (see `unbroken.tune.hyperband`).
- `PopulationBasedTraining(...)`: trials of the bottom quantile take over the checkpoint of
  one of the top quantile and change their hyperparameters (see `unbroken.tune.population`).
- `PB2(...)`: the same, with the new hyperparameters chosen within `hyperparam_bounds` by a
  Gaussian-process bandit (see `unbroken.tune.pb2`; needs `pip install 'unbroken[pb2]'`).
  Ray's module path works too: `unbroken.tune.schedulers.pb2`.

Ray's other schedulers (HyperBand for BOHB, median stopping, resource changing) are
refused at import with UnsupportedAPIError, which says what to use instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from unbroken.core import ray_names as _ray_names
from unbroken.tune.asha import ASHAScheduler
from unbroken.tune.hyperband import HyperBandScheduler
from unbroken.tune.pb2 import PB2
from unbroken.tune.pbt import PopulationBasedTraining


@dataclass
class FIFOScheduler:
    """No early stopping: every trial runs until its training function returns."""

    def describe(self) -> dict[str, Any]:
        return {"kind": "fifo"}


AsyncHyperBandScheduler = ASHAScheduler

__all__ = ["ASHAScheduler", "AsyncHyperBandScheduler", "FIFOScheduler", "HyperBandScheduler", "PB2",
           "PopulationBasedTraining"]


def __getattr__(name: str) -> Any:
    _ray_names.refuse(__name__, name)  # a Ray Tune name unbroken does not provide: says what instead
