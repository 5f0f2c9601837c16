"""unbroken.train: the Ray Train-style API for restorable training runs.

Driver side: configs, trainers, Checkpoint, Result, and the callbacks that observe a run
(Callback, UserCallback, TensorBoardLoggerCallback, MLflowLoggerCallback, WandbLoggerCallback). Worker side
(inside the training function): report, get_checkpoint, get_all_reported_checkpoints,
get_context, get_dataset_shard, and the `collective` operations. Ray Train V2 scripts port by
changing their imports; docs/porting-from-ray.md lists each Ray name and what unbroken does.

Layer 6 (public API, with the trainers in `trainer` and opening a run for fit() in
`open_run`): may import `core`, `state`, `store`, `run`, `worker`, `execution` and `observe`.
"""

from __future__ import annotations

from typing import Any

from unbroken.core import ray_names as _ray_names
from unbroken.core.codec import is_dataset_builder
from unbroken.core.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from unbroken.core.shipping import is_ray_dataset
from unbroken.core.validation_config import (
    ValidationConfig,
    ValidationFn,
    ValidationTaskConfig,
    validation_request,
)
from unbroken.errors import ControllerError, TrainingFailedError, WorkerGroupError
from unbroken.observe.mlflow_logger import MLflowLoggerCallback
from unbroken.observe.tensorboard_logger import TensorBoardLoggerCallback
from unbroken.observe.wandb_logger import WandbLoggerCallback
from unbroken.run.callbacks import Callback, RunInfo, UserCallback
from unbroken.run.result import Result
from unbroken.store.checkpoint import Checkpoint
from unbroken.store.commit import check_custom_name
from unbroken.train import collective
from unbroken.train.trainer import BaseTrainer, DataParallelTrainer
from unbroken.worker import dataset_shard as _dataset_shard
from unbroken.worker import ray_data_shard as _ray_data_shard
from unbroken.worker import session as _session
from unbroken.worker.report_config import (
    CheckpointConsistencyMode,
    CheckpointUploadMode,
    ReportedCheckpoint,
    ReportedCheckpointStatus,
    delete_after_upload,
)
from unbroken.worker.train_context import PreemptionInfo, StorageContext, TrainContext

__all__ = [
    "BaseTrainer", "Callback", "Checkpoint", "CheckpointConfig", "CheckpointConsistencyMode",
    "CheckpointUploadMode", "ControllerError", "DataParallelTrainer", "FailureConfig",
    "MLflowLoggerCallback", "ReportedCheckpoint", "ReportedCheckpointStatus", "Result", "RunConfig",
    "RunInfo", "ScalingConfig", "ValidationConfig", "ValidationFn", "ValidationTaskConfig",
    "StorageContext", "TensorBoardLoggerCallback", "TrainContext", "TrainingFailedError", "UserCallback",
    "WandbLoggerCallback",
    "WorkerGroupError",
    "PreemptionInfo",
    "collective", "get_all_reported_checkpoints", "get_checkpoint", "get_context", "get_dataset_shard",
    "get_preemption_info", "report", "TRAIN_DATASET_KEY",
]

# The dataset name Ray Train's trainers treat as the training set.
TRAIN_DATASET_KEY = "train"


def __getattr__(name: str) -> Any:
    _ray_names.refuse(__name__, name)  # a Ray Train name unbroken does not provide: says what instead


def report(metrics: dict[str, Any], checkpoint: Checkpoint | None = None,
           checkpoint_dir_name: str | None = None,
           checkpoint_upload_mode: CheckpointUploadMode = CheckpointUploadMode.SYNC,
           delete_local_checkpoint_after_upload: bool | None = None,
           checkpoint_upload_fn: Any = None, validation: bool | ValidationTaskConfig = False,
           validate_fn: Any = None, validate_config: Any = None) -> None:
    """Record one iteration's metrics (rank 0's are kept), optionally with checkpoint files.

    Collective: every rank calls it the same number of times. Any subset of ranks may attach
    a checkpoint directory; their files merge into one committed checkpoint.

    Ray Train V2's options: `checkpoint_dir_name` names the committed checkpoint directory
    (unique within the run, the same on every rank that gives one; default
    `checkpoint_<iteration>`). `checkpoint_upload_mode`: SYNC stages this rank's files before
    returning; ASYNC returns at once and stages them in the background, and the checkpoint
    commits when every rank's files are durable (leave the directory as it is until the next
    checkpoint report, unless it is to be deleted: then it is moved aside at once); neither
    waits for the commit; NO_UPLOAD is refused. `delete_local_checkpoint_after_upload`
    deletes the reported local directory once its files are staged (default: True for
    ASYNC, False for SYNC). `validation` (True, or a ValidationTaskConfig whose `fn_kwargs`
    override the trainer's): once the checkpoint commits, the trainer's
    `ValidationConfig.fn` runs on it in its own process while training goes on, and what it
    returns merges into the checkpoint's metrics (see docs/restore.md). `checkpoint_upload_fn`
    and Ray's older `validate_fn` / `validate_config` are refused with UnsupportedOptionError,
    which says what to do instead.
    """
    if checkpoint_dir_name is not None:
        check_custom_name(checkpoint_dir_name)
    delete_local = delete_after_upload(checkpoint_upload_mode, delete_local_checkpoint_after_upload,
                                       checkpoint_upload_fn, validate_fn, validate_config)
    request = validation_request(validation)
    session = _session.current("train.report()")
    if request is not None and checkpoint is None:
        raise ValueError("train.report(validation=...) validates the checkpoint of that report, and "
                         "this report has none. Hint: pass checkpoint=... with it, or drop validation")
    if request is not None and not session.info.validates:
        raise ValueError("train.report(validation=...) needs the trainer's ValidationConfig, and this "
                         "trainer has none. Hint: pass validation_config=ValidationConfig(fn=...) "
                         "to the trainer")
    session.report(metrics, checkpoint, checkpoint_dir_name, delete_local and checkpoint is not None,
                   asynchronous=checkpoint_upload_mode is CheckpointUploadMode.ASYNC, validation=request)


def get_checkpoint() -> Checkpoint | None:
    """The checkpoint to resume from: the run's latest committed one, or resume_from_checkpoint."""
    return _session.current("train.get_checkpoint()").get_checkpoint()


def get_all_reported_checkpoints(
        consistency_mode: CheckpointConsistencyMode = CheckpointConsistencyMode.VALIDATED,
        timeout_s: float | None = None) -> list[ReportedCheckpoint]:
    """Every committed checkpoint of the run so far, oldest first, with its metrics and
    status (Ray Train V2). Waits until the checkpoint of this rank's latest report is
    committed, and with VALIDATED (the default) also until every validation asked for so far
    has ended. `timeout_s` is accepted and unused: bound a validation with
    `ValidationTaskConfig(timeout_s=...)`. Includes earlier attempts' checkpoints, and not the
    ones retention (`num_to_keep`) deleted."""
    if not isinstance(consistency_mode, CheckpointConsistencyMode):
        raise TypeError(f"consistency_mode must be a CheckpointConsistencyMode, got {consistency_mode!r}")
    session = _session.current("train.get_all_reported_checkpoints()")
    return session.reported_checkpoints(validated=consistency_mode is CheckpointConsistencyMode.VALIDATED)


def get_preemption_info() -> PreemptionInfo | None:
    """None until the run has a preemption notice; then which ranks' machines go away and by
    when (Ray Train V2's name). The driver stops the attempt at a checkpoint by itself (the
    next report's, or the last report's, saved just in time); this is for a loop that acts
    too. Like `get_context().should_checkpoint()`, it waits for the driver's reply to this
    rank's last report, so every rank gets the same answer between the same reports."""
    info = _session.current("train.get_preemption_info()").preemption()
    return None if info is None else PreemptionInfo(info["deadline_ms"], info["preempted_node_to_ranks"])


def get_context() -> TrainContext:
    """This worker's ranks, sizes, run name, storage path and attempt number."""
    return _session.current("train.get_context()").context


def get_dataset_shard(name: str) -> Any:
    """This rank's shard of `datasets[name]`: every world_size-th item from this rank on (a list
    or tuple for list and tuple datasets, else a `torch.utils.data.Subset`). For a
    `ray.data.Dataset` (on the Ray engine), a `RayDataShard`: `iter_torch_batches`,
    `iter_batches` and `iter_rows` as in Ray Train, with a position `TrainState(loader=shard)`
    saves, so a resumed run continues each rank at its next batch.

    `prepare_data_loader`, Lightning under `RayDDPStrategy` and the Transformers Trainer after
    `prepare_trainer` recognise a shard and share out the dataset it was cut from instead of
    splitting it again."""
    session = _session.current("train.get_dataset_shard()")
    given = session.datasets.get(name)
    if is_ray_dataset(given):
        return _ray_data_shard.shard_of(session, name, given)
    if not is_dataset_builder(given):  # (a name not given: the session's KeyError says so)
        return _dataset_shard.mark(session.get_dataset_shard(name), given)
    whole = given()  # built once here, so the shard's whole dataset is the one it was cut from
    info = session.info
    return _dataset_shard.mark(_dataset_shard.shard(whole, info.world_rank, info.world_size), whole)
