"""unbroken.train: the Ray Train-style API for restorable training runs.

Driver side: configs, trainers, Checkpoint, Result, and the callbacks that observe a run
(Callback, TensorBoardLoggerCallback, MLflowLoggerCallback). Worker side (inside the training
function): report, get_checkpoint, get_context, get_dataset_shard.
"""

from __future__ import annotations

from typing import Any

from unbroken import session as _session
from unbroken.callbacks import Callback, RunInfo
from unbroken.checkpoint import Checkpoint
from unbroken.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from unbroken.errors import TrainingFailedError
from unbroken.mlflow_logger import MLflowLoggerCallback
from unbroken.result import Result
from unbroken.session import TrainContext
from unbroken.tensorboard_logger import TensorBoardLoggerCallback
from unbroken.trainer import BaseTrainer, DataParallelTrainer

__all__ = [
    "BaseTrainer", "Callback", "Checkpoint", "CheckpointConfig", "DataParallelTrainer", "FailureConfig",
    "MLflowLoggerCallback", "Result", "RunConfig", "RunInfo", "ScalingConfig", "TensorBoardLoggerCallback",
    "TrainContext", "TrainingFailedError",
    "get_checkpoint", "get_context", "get_dataset_shard", "report",
]


def report(metrics: dict[str, Any], checkpoint: Checkpoint | None = None) -> None:
    """Record one iteration's metrics (rank 0's are kept), optionally with checkpoint files.

    Collective: every rank calls it the same number of times. Any subset of ranks may attach
    a checkpoint directory; their files merge into one committed checkpoint.
    """
    _session.current("train.report()").report(metrics, checkpoint)


def get_checkpoint() -> Checkpoint | None:
    """The checkpoint to resume from: the run's latest committed one, or resume_from_checkpoint."""
    return _session.current("train.get_checkpoint()").get_checkpoint()


def get_context() -> TrainContext:
    """This worker's ranks, sizes, run name, storage path and attempt number."""
    return _session.current("train.get_context()").context


def get_dataset_shard(name: str) -> Any:
    """This rank's shard of `datasets[name]`."""
    return _session.current("train.get_dataset_shard()").get_dataset_shard(name)
