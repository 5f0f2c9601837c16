"""Ray Tune's `ray.tune.search.nevergrad` module path: importing it fails at once with
UnsupportedAPIError saying what to use instead of `NevergradSearch`."""

from unbroken.core import ray_names as _ray_names

_ray_names.refuse("unbroken.tune.search", "NevergradSearch")
