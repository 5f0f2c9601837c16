"""Ray Tune's `ray.tune.execution` package path, which holds Ray's trial executor: unbroken
has none to offer, so its modules here, `placement_groups` and `tune_controller`, refuse at
import, and a Ray Tune name asked of the package itself is refused with what to use instead."""

from typing import Any

from unbroken.core import ray_names as _ray_names


def __getattr__(name: str) -> Any:
    _ray_names.refuse("unbroken.tune", name)  # PlacementGroupFactory: the hint names with_resources
