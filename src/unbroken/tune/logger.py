"""Ray Tune's module path `ray.tune.logger`: `LoggerCallback`, the base class of sweep logger
callbacks (defined in `unbroken.tune.callback`). Each trial writes its own result.json and
progress.csv, so Ray's CSV and JSON logger callbacks have nothing left to do."""

from typing import Any

from unbroken.core import ray_names as _ray_names
from unbroken.tune.callback import LoggerCallback

__all__ = ["LoggerCallback"]


def __getattr__(name: str) -> Any:
    _ray_names.refuse(__name__, name)  # a Ray Tune name unbroken does not provide: says what instead
