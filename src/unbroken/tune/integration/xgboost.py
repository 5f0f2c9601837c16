"""Ray Tune's `ray.tune.integration.xgboost` module path: importing it fails at once with
UnsupportedAPIError saying how to report from XGBoost's training loop instead of Ray's callbacks."""

from unbroken.core import ray_names as _ray_names

_ray_names.refuse("unbroken.tune.integration", "xgboost")
