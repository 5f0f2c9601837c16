"""Which of this machine's GPUs each running trial of a sweep sees.

On the local engine a run's workers take the GPUs the process sees, by local rank. Trials
running side by side would all take the first ones; so the sweep gives each trial GPUs of
its own, through `CUDA_VISIBLE_DEVICES` in the trial's process, and starts a trial only when
enough GPUs are free. Where the driver itself was given `CUDA_VISIBLE_DEVICES`, the trials
share out those. On a Ray cluster Ray places GPUs, and this is not used.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from unbroken.core.config import ScalingConfig

ENV = "CUDA_VISIBLE_DEVICES"


def gpus_per_trial(scaling: ScalingConfig) -> int:
    """The GPUs one trial's workers take (1 per worker with use_gpu, unless resources_per_worker
    says otherwise; a fraction of a GPU per worker rounds the trial's total up)."""
    if not scaling.use_gpu:
        return 0
    per_worker = (scaling.resources_per_worker or {}).get("GPU", 1)
    return math.ceil(scaling.max_workers * per_worker - 1e-9)


@dataclass
class GpuSlots:
    """The GPU ids free for the next trial (names as `CUDA_VISIBLE_DEVICES` takes them)."""

    per_trial: int
    free: list[str] = field(default_factory=list)

    @classmethod
    def of_machine(cls, scaling: ScalingConfig, count: Callable[[], int]) -> GpuSlots | None:
        """The slots of a sweep whose trials take `scaling`, on a machine whose processes see
        `count()` GPUs (asked only when they take GPUs); None when its trials take none."""
        per_trial = gpus_per_trial(scaling)
        if per_trial == 0:
            return None
        given = os.environ.get(ENV)
        if given:
            return cls(per_trial, [g.strip() for g in given.split(",") if g.strip()])
        return cls(per_trial, [str(i) for i in range(count())])

    @property
    def trials(self) -> int:
        """How many trials the free GPUs hold now."""
        return len(self.free) // self.per_trial

    def take(self) -> list[str] | None:
        """GPUs for one more trial, or None when too few are free."""
        if len(self.free) < self.per_trial:
            return None
        taken, self.free = self.free[:self.per_trial], self.free[self.per_trial:]
        return taken

    def give(self, ids: list[str]) -> None:
        self.free = sorted(set(self.free) | set(ids), key=lambda g: (len(g), g))
