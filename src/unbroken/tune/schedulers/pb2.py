"""Ray Tune's module path `ray.tune.schedulers.pb2`: `PB2` is not provided; importing it says
what to use instead (UnsupportedAPIError)."""

from typing import Any

from unbroken.core import ray_names as _ray_names


def __getattr__(name: str) -> Any:
    _ray_names.refuse("unbroken.tune.schedulers", name)  # PB2: the hint names PopulationBasedTraining
