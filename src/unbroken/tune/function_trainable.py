"""`tune.with_parameters` and `tune.with_resources`: what a function trainable is given besides
its config (Ray Tune's names).

`with_parameters(trainable, **objects)` hands `objects` to each call of the function as keyword
arguments: a dataset, a tokenizer, anything too large or too live to go into a config. They
are never saved: not into the sweep's directory, not into a trial's run. A restore takes them
again, as a run's arguments that cannot be saved are re-specified (`Tuner.restore(path,
trainable=tune.with_parameters(train_fn, data=data))`); the trials' workers get them the way
they get the function itself (inherited by a forked process, pickled to any other).

`with_resources(trainable, {"cpu": 2, "gpu": 1})` (or a ScalingConfig of one worker) says what
one trial takes: its worker's resources, how many trials the machine runs at once, and on a
GPU machine which GPUs each trial sees (`CUDA_VISIBLE_DEVICES`, set per trial by the sweep).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unbroken.core.config import ScalingConfig
from unbroken.train.trainer import BaseTrainer
from unbroken.tune.trainable import is_trainable_class

_KNOWN = {"cpu": "CPU", "gpu": "GPU"}


class FunctionTrainable:
    """A function trainable with the keyword arguments and resources the two helpers added.
    Called as the function is, `trainable(config)`."""

    def __init__(self, function: Callable[..., Any], parameters: dict[str, Any] | None = None,
                 resources: ScalingConfig | None = None) -> None:
        self.function = function
        self.parameters = dict(parameters or {})
        self.resources = resources
        self.__name__ = getattr(function, "__name__", type(function).__name__)

    def __call__(self, config: dict[str, Any]) -> Any:
        return self.function(config, **self.parameters)

    def __repr__(self) -> str:
        extra = [f"parameters={sorted(self.parameters)}"] if self.parameters else []
        if self.resources is not None:
            extra.append(f"resources={self.resources.resources_per_worker}")
        return f"{self.__name__}({', '.join(extra)})"

    @property
    def unbroken_respecify(self) -> bool:
        """Never saved while it holds objects: a restore takes it again (see the module docstring)."""
        return bool(self.parameters)

    def without_parameters(self) -> FunctionTrainable:
        """What a sweep saves of it: the function and its resources."""
        return FunctionTrainable(self.function, None, self.resources)

    def scaling_config(self) -> ScalingConfig:
        """One worker with the trial's resources (1 CPU when none were given)."""
        return self.resources or ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1})


def with_parameters(trainable: Callable[..., Any], **parameters: Any) -> FunctionTrainable:
    """`trainable`, called as `trainable(config, **parameters)` in every trial; the
    parameters are never saved (a restore takes the trainable again)."""
    base = _function(trainable, "with_parameters")
    if not parameters:
        raise ValueError("tune.with_parameters needs at least one keyword argument, e.g. "
                         "tune.with_parameters(train_fn, data=data)")
    if "config" in parameters:
        raise ValueError("tune.with_parameters(..., config=...): `config` is the trial's config, passed "
                         "first. Hint: name the object otherwise")
    return FunctionTrainable(base.function, {**base.parameters, **parameters}, base.resources)


def with_resources(trainable: Callable[..., Any],
                   resources: dict[str, float] | ScalingConfig) -> FunctionTrainable:
    """`trainable`, run in each trial by one worker with `resources`: {"cpu": 2, "gpu": 1}
    (Ray's keys; other keys are custom resources, for the Ray engine), or a ScalingConfig of
    one worker."""
    base = _function(trainable, "with_resources")
    return FunctionTrainable(base.function, base.parameters, _scaling(resources))


def _function(trainable: Any, helper: str) -> FunctionTrainable:
    if isinstance(trainable, FunctionTrainable):
        return trainable
    if isinstance(trainable, BaseTrainer):
        raise TypeError(f"tune.{helper} takes a function trainable, got a {type(trainable).__name__}. Hint: "
                        "a Trainer's scaling_config says what its trial takes, and its train_loop_config "
                        "what its function gets")
    if (isinstance(trainable, type) and not is_trainable_class(trainable)) or not callable(trainable):
        raise TypeError(f"tune.{helper} takes a function (config) or a tune.Trainable subclass, got "
                        f"{trainable!r}")
    return FunctionTrainable(trainable)


def _scaling(resources: Any) -> ScalingConfig:
    if isinstance(resources, ScalingConfig):
        if resources.max_workers != 1:
            raise ValueError("tune.with_resources(trainable, ScalingConfig(...)): a function trainable runs "
                             f"on one worker, got num_workers={resources.num_workers!r}. Hint: for several "
                             "workers per trial, sweep a TorchTrainer")
        return resources
    if not isinstance(resources, dict) or not resources:
        raise TypeError("tune.with_resources takes a dict such as {'cpu': 2, 'gpu': 1} or a "
                        f"ScalingConfig, got {resources!r}. Hint: a function of the config (Ray's third "
                        "form) is not supported: every trial takes the same resources")
    per_worker: dict[str, float] = {}
    for key, amount in resources.items():
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount < 0:
            raise ValueError(f"tune.with_resources: {key!r} must be a number >= 0, got {amount!r}")
        per_worker[_KNOWN.get(key.lower(), key) if isinstance(key, str) else key] = amount
    per_worker.setdefault("CPU", 1)
    return ScalingConfig(num_workers=1, resources_per_worker=per_worker,
                         use_gpu=per_worker.get("GPU", 0) > 0)
