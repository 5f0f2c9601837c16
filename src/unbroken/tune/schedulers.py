"""Trial schedulers for `TuneConfig(scheduler=...)` (Ray Tune's names).

- `FIFOScheduler()`: every trial runs to its end (the default).
- `ASHAScheduler(time_attr, metric, mode, max_t, grace_period, reduction_factor)`: early
  stopping by asynchronous successive halving; `AsyncHyperBandScheduler` is the same class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from unbroken.tune.asha import ASHAScheduler


@dataclass
class FIFOScheduler:
    """No early stopping: every trial runs until its training function returns."""

    def describe(self) -> dict[str, Any]:
        return {"kind": "fifo"}


AsyncHyperBandScheduler = ASHAScheduler

__all__ = ["ASHAScheduler", "AsyncHyperBandScheduler", "FIFOScheduler"]
