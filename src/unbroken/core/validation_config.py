"""Asynchronous checkpoint validation, as Ray Train V2's: `ValidationConfig` on the trainer
says which function validates a checkpoint; `train.report(..., validation=True |
ValidationTaskConfig(...))` asks for it on the checkpoint of that report. The function runs
on the committed checkpoint in its own process while training goes on (see
`unbroken.execution.validations`); what it returns merges into the checkpoint's metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class ValidationFn(Protocol):
    """A function that validates a checkpoint: `fn(checkpoint, **fn_kwargs) -> dict` of
    metrics (JSON values), which overwrite the reported ones of the same name."""

    def __call__(self, checkpoint: Any, **kwargs: Any) -> dict: ...


@dataclass
class ValidationTaskConfig:
    """One validation's settings, given to `train.report(validation=...)`.

    `fn_kwargs`: JSON keyword arguments for the function, over the trainer's defaults
    (`ValidationConfig.task_config`). `timeout_s`: how long the validation may take (None: no
    limit); past it, it is stopped and its status is VALIDATION_TIMEOUT.
    """

    fn_kwargs: dict[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.fn_kwargs is None:
            self.fn_kwargs = {}
        if not isinstance(self.fn_kwargs, dict):
            raise TypeError(f"ValidationTaskConfig.fn_kwargs must be a dict, got {self.fn_kwargs!r}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"ValidationTaskConfig.timeout_s must be None or above 0, got "
                             f"{self.timeout_s!r}")


@dataclass
class ValidationConfig:
    """The trainer's validation: `fn(checkpoint, **fn_kwargs)` returns a dict of metrics.

    `task_config`: the defaults of every validation (its `fn_kwargs` are overridden key by
    key by a report's). `ray_remote_kwargs`: options of the Ray task the validation runs in
    on the Ray engine (e.g. `{"num_cpus": 2}`); unused by the local engine, which runs each
    validation in a process of its own on this machine.
    """

    fn: Any
    task_config: ValidationTaskConfig | None = None
    ray_remote_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"ValidationConfig.fn must be a function, got {self.fn!r}")
        if self.task_config is None:
            self.task_config = ValidationTaskConfig()
        if not isinstance(self.task_config, ValidationTaskConfig):
            raise TypeError(f"ValidationConfig.task_config must be a ValidationTaskConfig, got "
                            f"{self.task_config!r}")
        self.ray_remote_kwargs = dict(self.ray_remote_kwargs or {})


def validation_request(validation: Any) -> dict[str, Any] | None:
    """What a report's `validation=` asks for, as stored with its checkpoint: None (no
    validation), or {"fn_kwargs": ..., "timeout_s": ...} (None values: the trainer's defaults)."""
    if validation is False or validation is None:
        return None
    if validation is True:
        return {"fn_kwargs": {}, "timeout_s": None}
    if isinstance(validation, ValidationTaskConfig):
        return {"fn_kwargs": dict(validation.fn_kwargs), "timeout_s": validation.timeout_s}
    raise TypeError(f"train.report(validation=...) must be True, False or a ValidationTaskConfig, "
                    f"got {validation!r}")


def resolved(config: ValidationConfig, request: dict[str, Any]) -> tuple[dict[str, Any], float | None]:
    """(the keyword arguments, the timeout) of a stored request under the trainer's defaults."""
    defaults = config.task_config or ValidationTaskConfig()
    kwargs = {**defaults.fn_kwargs, **(request.get("fn_kwargs") or {})}
    timeout = request.get("timeout_s")
    return kwargs, timeout if timeout is not None else defaults.timeout_s
