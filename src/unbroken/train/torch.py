"""TorchTrainer: DataParallelTrainer with a torch.distributed process group, and the worker-side
torch helpers: prepare_model, prepare_data_loader, get_device and TrainState (exact resume)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch  # (imported before the engine forks workers, so they inherit it)

from unbroken.core import ray_names as _ray_names
from unbroken.core.config import RunConfig, ScalingConfig
from unbroken.core.validation_config import ValidationConfig
from unbroken.execution.engine import local as _local
from unbroken.state.reproducibility import enable_reproducibility
from unbroken.store.checkpoint import Checkpoint
from unbroken.train.trainer import DataParallelTrainer
from unbroken.worker.torch_backend import (
    DeviceDataLoader,
    ResumableDataLoader,
    TorchConfig,
    get_device,
    prepare_data_loader,
    prepare_model,
)
from unbroken.worker.train_state import TrainState

_local.mark_clean()

__all__ = ["DeviceDataLoader", "ResumableDataLoader", "TorchConfig", "TorchTrainer", "TrainState",
           "enable_reproducibility", "get_device", "get_devices", "prepare_data_loader", "prepare_model"]


def get_devices() -> list[torch.device]:
    """This worker's devices (Ray Train V2): one per worker here, `[get_device()]`."""
    return [get_device()]


def __getattr__(name: str) -> Any:
    _ray_names.refuse(__name__, name)  # a Ray Train name unbroken does not provide: says what instead


class TorchTrainer(DataParallelTrainer):
    """Runs `train_loop_per_worker(config)` on each worker inside a torch.distributed group."""

    def __init__(self, train_loop_per_worker: Callable[..., None], *,
                 train_loop_config: dict[str, Any] | None = None,
                 torch_config: TorchConfig | None = None,
                 scaling_config: ScalingConfig | None = None, run_config: RunConfig | None = None,
                 datasets: dict[str, Any] | None = None,
                 resume_from_checkpoint: Checkpoint | None = None,
                 validation_config: ValidationConfig | None = None) -> None:
        super().__init__(train_loop_per_worker, train_loop_config=train_loop_config,
                         scaling_config=scaling_config, run_config=run_config, datasets=datasets,
                         resume_from_checkpoint=resume_from_checkpoint,
                         backend_config=torch_config or TorchConfig(), validation_config=validation_config)
