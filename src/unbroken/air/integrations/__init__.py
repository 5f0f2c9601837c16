"""Ray AIR's `ray.air.integrations` package path: Ray's MLflow and W&B modules here refuse at
import with UnsupportedAPIError naming unbroken.train's logger callbacks of the same names,
and so does `from unbroken.air.integrations import mlflow`."""

from typing import Any

from unbroken.core import ray_names as _ray_names


def __getattr__(name: str) -> Any:
    _ray_names.refuse(__name__, name)
