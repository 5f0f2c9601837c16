"""Ray Tune's `ray.tune.experiment` module path: `Trial`, what callbacks and
`TuneConfig(trial_name_creator=...)` are given (`unbroken.tune.callback.Trial`). Ray's
`Experiment` is refused with UnsupportedAPIError saying to use `tune.Tuner`."""

from __future__ import annotations

from typing import Any

from unbroken.core import ray_names as _ray_names
from unbroken.tune.callback import Trial

__all__ = ["Trial"]


def __getattr__(name: str) -> Any:
    if name == "Experiment":
        _ray_names.refuse("unbroken.tune", name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
