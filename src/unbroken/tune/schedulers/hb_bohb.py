"""Ray Tune's `ray.tune.schedulers.hb_bohb` module path: importing it fails at once with
UnsupportedAPIError saying what to use instead of `HyperBandForBOHB` (HyperBandScheduler)."""

from unbroken.core import ray_names as _ray_names

_ray_names.refuse("unbroken.tune.schedulers", "HyperBandForBOHB")
