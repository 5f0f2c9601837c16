"""Ray Tune's `ray.tune.integration` package path: Ray's callbacks that report from other
libraries' training loops (LightGBM, XGBoost, Keras, PyTorch Lightning) are not provided.
Each of Ray's modules here refuses at import with UnsupportedAPIError naming what to do
instead, and so does `from unbroken.tune.integration import xgboost`."""

from typing import Any

from unbroken.core import ray_names as _ray_names


def __getattr__(name: str) -> Any:
    _ray_names.refuse(__name__, name)
