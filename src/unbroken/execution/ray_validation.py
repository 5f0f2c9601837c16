"""The Ray engine's validations: each one is a Ray task with `ValidationConfig.ray_remote_kwargs`
as its options, so it runs where the cluster has room for it."""

from __future__ import annotations

import os
import sys
from typing import Any

import cloudpickle

from unbroken.core.validation_config import ValidationConfig
from unbroken.execution.validation_process import checked_metrics
from unbroken.store.checkpoint import Checkpoint


def _run(fn_blob: bytes, checkpoint: Checkpoint, kwargs: dict[str, Any], sys_path: list[str]) -> dict:
    # The driver's import path, as the worker actors get it: a function saved by reference
    # (from the driver's own modules) imports on the node as it did on the driver.
    sys.path.extend(p for p in sys_path if p not in sys.path and os.path.isdir(p))
    return checked_metrics(cloudpickle.loads(fn_blob)(checkpoint, **kwargs))


class RayValidation:
    """One validation as a Ray task."""

    def __init__(self, config: ValidationConfig, checkpoint: Checkpoint, kwargs: dict[str, Any]) -> None:
        import ray

        self._ray = ray
        task = ray.remote(_run).options(**{"num_cpus": 1, **(config.ray_remote_kwargs or {})})
        self._ref = task.remote(cloudpickle.dumps(config.fn), checkpoint, kwargs, list(sys.path))
        self._result: tuple[dict[str, Any] | None, str] | None = None

    def wait(self, timeout: float) -> bool:
        if self._result is None:
            done, _ = self._ray.wait([self._ref], timeout=timeout)
            if not done:
                return False
            try:
                self._result = (self._ray.get(self._ref), "")
            except Exception as e:  # a RayTaskError carries the function's traceback
                self._result = (None, str(e))
        return True

    def outcome(self) -> tuple[dict[str, Any] | None, str]:
        assert self._result is not None
        return self._result

    def cancel(self) -> None:
        if self._result is None:
            self._ray.cancel(self._ref, force=True)
