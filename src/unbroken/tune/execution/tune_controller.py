"""Ray Tune's `ray.tune.execution.tune_controller` module path: importing it fails at once
with UnsupportedAPIError saying what to use instead of `TuneController` (`tune.Tuner`)."""

from unbroken.core import ray_names as _ray_names

_ray_names.refuse("unbroken.tune", "TuneController")
