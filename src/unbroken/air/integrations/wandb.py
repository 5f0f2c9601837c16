"""Ray AIR's `ray.air.integrations.wandb` module path: importing it fails at once with
UnsupportedAPIError naming `unbroken.train.WandbLoggerCallback` (the callback under Ray's name)
and saying what to do instead of `setup_wandb`."""

from unbroken.core import ray_names as _ray_names

_ray_names.refuse("unbroken.air.integrations", "wandb")
