"""Ray Tune's `ray.tune.execution.placement_groups` module path: importing it fails at once
with UnsupportedAPIError saying what to use instead of `PlacementGroupFactory`
(`tune.with_resources` or a Trainer's `ScalingConfig`)."""

from unbroken.core import ray_names as _ray_names

_ray_names.refuse("unbroken.tune", "PlacementGroupFactory")
