"""The Ray Train names unbroken does not provide, each with what to do instead.

`unbroken.train` and `unbroken.train.torch` look a missing name up here (their module
`__getattr__`), so that a script ported from Ray that imports one fails at that import with
UnsupportedAPIError saying what to use, not with a bare "cannot import name". The full list
of Ray Train V2's names and what unbroken does with each is docs/porting-from-ray.md.
"""

from __future__ import annotations

from unbroken.errors import UnsupportedAPIError

_NO_VALIDATION = ("unbroken runs no validation tasks. Hint: evaluate in the training function and "
                  "report the result as a metric with the checkpoint")

NOT_PROVIDED: dict[str, dict[str, str]] = {
    "unbroken.train": {
        "DataConfig": "datasets are split among the ranks by train.get_dataset_shard(name). Hint: drop "
                      "dataset_config and pass datasets={...} to the trainer",
        "LoggingConfig": "unbroken logs through the 'unbroken' logger. Hint: configure it with the logging "
                         "module, and choose the progress display with RunConfig(verbose=0|1|2)",
        "SyncConfig": "each rank writes its checkpoint files straight to storage_path; there is nothing to "
                      "sync. Hint: drop sync_config",
        "BackendConfig": "the only backend is torch.distributed. Hint: pass "
                         "unbroken.train.torch.TorchConfig(backend=..., timeout_s=...)",
        "ValidationConfig": _NO_VALIDATION,
        "ValidationFn": _NO_VALIDATION,
        "ValidationTaskConfig": _NO_VALIDATION,
        "ReportedCheckpointStatus": "every checkpoint get_all_reported_checkpoints returns is committed "
                                    "(there is no validation). Hint: drop the status check",
        "get_preemption_info": "the driver, not the cloud, tells the workers about a preemption. Hint: "
                               "checkpoint at the report where train.get_context().should_checkpoint() "
                               "is true (TrainState does it by itself)",
        "PreemptionInfo": "see get_preemption_info. Hint: use train.get_context().should_checkpoint()",
        "PreemptionError": "a SIGTERM/SIGINT to the driver commits a checkpoint and raises "
                           "TrainingInterruptedError, a TrainingFailedError. Hint: catch "
                           "unbroken.errors.TrainingInterruptedError",
    },
    "unbroken.train.torch": {
        "TorchXLAConfig": "unbroken runs torch.distributed on CPUs and CUDA GPUs only. Hint: use TorchConfig",
        "accelerate": "Ray's automatic mixed precision helpers are not provided. Hint: use torch.autocast "
                      "and torch.amp.GradScaler in the training function",
        "backward": "see accelerate. Hint: call loss.backward() (with a GradScaler for mixed precision)",
        "prepare_optimizer": "see accelerate. Hint: use the optimizer as it is",
        "TorchCheckpoint": "checkpoints are plain directories. Hint: torch.save into a directory and "
                           "report Checkpoint.from_directory(it), or use TrainState",
        "LegacyTorchCheckpoint": "see TorchCheckpoint. Hint: use Checkpoint.from_directory",
        "TorchPredictor": "batch prediction is not part of unbroken. Hint: load the checkpoint with "
                          "torch.load in your own inference code",
        "TorchDetectionPredictor": "see TorchPredictor",
    },
}


def refuse(module: str, name: str) -> None:
    """UnsupportedAPIError for a Ray Train name unbroken does not provide; AttributeError for
    any other missing name (what a module's `__getattr__` must raise)."""
    hint = NOT_PROVIDED.get(module, {}).get(name)
    if hint is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    raise UnsupportedAPIError(f"{module}.{name} (Ray Train's) is not provided: {hint}", name=name)
