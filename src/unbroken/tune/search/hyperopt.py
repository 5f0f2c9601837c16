"""Ray Tune's `ray.tune.search.hyperopt` module path: importing it fails at once with
UnsupportedAPIError saying what to use instead of `HyperOptSearch`."""

from unbroken.core import ray_names as _ray_names

_ray_names.refuse("unbroken.tune.search", "HyperOptSearch")
