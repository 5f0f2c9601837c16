"""Ray AIR's `ray.air.integrations.mlflow` module path: importing it fails at once with
UnsupportedAPIError naming `unbroken.train.MLflowLoggerCallback` (the callback under Ray's name)
and saying what to do instead of `setup_mlflow`."""

from unbroken.core import ray_names as _ray_names

_ray_names.refuse("unbroken.air.integrations", "mlflow")
