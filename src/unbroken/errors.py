"""Exception types. Each names the problem and carries a hint on how to fix it."""

from __future__ import annotations


class UnbrokenError(Exception):
    """Base class for errors raised by unbroken."""


class TrainingFailedError(UnbrokenError, RuntimeError):
    """fit() could not finish; the run is kept on storage and can be restored."""


class TrainingInterruptedError(TrainingFailedError):
    """fit() stopped on SIGTERM/SIGINT after committing a checkpoint; the run can be restored."""


class WorkerError(UnbrokenError, RuntimeError):
    """A worker process raised or died. Carries the remote traceback as text."""

    def __init__(self, message: str, rank: int | None = None, traceback_text: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.traceback_text = traceback_text

    def __str__(self) -> str:
        base = super().__str__()
        return f"{base}\n{self.traceback_text}" if self.traceback_text else base


class WorkerHangError(WorkerError):
    """No rank reported within FailureConfig.hang_timeout_s (a deadlocked collective, a stuck rank)."""


class RunNotFoundError(UnbrokenError, FileNotFoundError):
    """There is no run at the given path."""


class RunExistsError(UnbrokenError, FileExistsError):
    """A run exists where a new one was asked for (resume="never")."""


class CorruptRunError(UnbrokenError, ValueError):
    """The run's manifest is unreadable and no valid generation remains."""


class SchemaVersionError(UnbrokenError, ValueError):
    """The run was written by a newer version of unbroken."""


class IdentityMismatchError(UnbrokenError, ValueError):
    """The run's identity (trainer class, train_loop_config, dataset names) differs from the saved run."""


class RestoreArgumentError(UnbrokenError, ValueError):
    """A saved constructor argument cannot be loaded, or must be re-specified and was not."""


class UnknownOverrideError(UnbrokenError, TypeError):
    """restore() got an argument the trainer's constructor does not take."""


class UnsavableArgumentError(UnbrokenError, TypeError):
    """A constructor argument can be neither saved as JSON nor pickled, so the run could not be restored."""


class TrainerClassMismatchError(UnbrokenError, TypeError):
    """restore() was called on a class unrelated to the one that saved the run."""


class LeaseHeldError(UnbrokenError, RuntimeError):
    """Another live driver holds the run."""


class LeaseLostError(LeaseHeldError):
    """Another driver took this run over (this driver's heartbeat was stale); this one stops."""


class StorageError(UnbrokenError, OSError):
    """Storage is missing a filesystem package or cannot be written."""


class TornCheckpointError(UnbrokenError, ValueError):
    """A checkpoint's files do not match its commit marker."""


class CheckpointConflictError(UnbrokenError, ValueError):
    """Two ranks attached different files under the same name to one checkpoint."""


class CheckpointNameError(CheckpointConflictError):
    """train.report(checkpoint_dir_name=...) gave a name that cannot name a checkpoint
    directory, that the run already has, or that differs between the ranks of one report.
    Never retried: a restart would give the same name again."""


class CheckpointChangedError(CheckpointConflictError):
    """A directory reported with an asynchronous save (`CheckpointUploadMode.ASYNC` without
    deleting it) was changed or removed before its files were staged. Never retried: a
    restart would change it again."""


class UnsupportedOptionError(UnbrokenError, ValueError):
    """A Ray Train option that unbroken does not support; the message says what to do instead."""


class UnsupportedAPIError(UnbrokenError, ImportError):
    """A Ray Train or Ray Tune name that unbroken does not provide, imported from unbroken's
    module of the same role (unbroken.train, .train.torch, .train.lightning, .train.huggingface,
    unbroken.tune.schedulers), or a Ray module path with nothing unbroken provides
    (unbroken.tune.integration.xgboost, ...); the message says what to use instead."""


class WorkerGroupError(TrainingFailedError):
    """fit() gave up after a failure in the worker group: a rank raised, died or hung.

    `worker_failures` maps the failed rank (-1 when unknown) to its error (Ray Train V2)."""

    def __init__(self, message: str, worker_failures: dict[int, BaseException] | None = None) -> None:
        super().__init__(message)
        self.worker_failures = dict(worker_failures or {})


class ControllerError(TrainingFailedError):
    """fit() gave up after a failure in the driver itself (storage, a commit, the run's
    bookkeeping); `controller_failure` is that error (Ray Train V2)."""

    def __init__(self, message: str, controller_failure: BaseException | None = None) -> None:
        super().__init__(message)
        self.controller_failure = controller_failure


class MetricsNotSerializableError(UnbrokenError, TypeError):
    """train.report got a metric value that cannot be recorded as JSON."""


class ReportMismatchError(UnbrokenError, RuntimeError):
    """train.report was called a different number of times on different ranks."""


class StateMismatchError(UnbrokenError, ValueError):
    """A checkpoint does not fit what it is restored into: it was not written by TrainState,
    or it holds different objects, or a data order for a different dataset size or seed."""


class UnknownMetricError(UnbrokenError, ValueError):
    """A metric name was asked for that the run never recorded."""


class SearchSpaceError(UnbrokenError, ValueError):
    """A Tuner's param_space holds a value unbroken cannot sample (an unknown search-space
    object, a domain under a non-string key, bounds that are out of order)."""


class NotASweepError(UnbrokenError, ValueError):
    """Tuner.restore or Tuner.can_restore was given a path that is not a sweep root."""


class SweepMismatchError(IdentityMismatchError):
    """A sweep's search space or tune settings differ from the ones it was started with."""


class PickleRefusedError(RestoreArgumentError):
    """restore(..., allow_pickle=False) would have had to unpickle something stored with the run
    (unpickling can run code); nothing was unpickled."""


class InsufficientResourcesError(UnbrokenError, RuntimeError):
    """The engine cannot give the workers what ScalingConfig asks for (e.g. use_gpu=True on a
    machine where no GPU is visible)."""


class StorageFullError(StorageError):
    """The run's storage ran out of space (ENOSPC, or an object store's quota) while writing."""


class WorkerDied(UnbrokenError, RuntimeError):
    """A rank's worker ended without saying it was done: its process exited or was killed by
    a signal, or the node it ran on was lost. The engine says which; the controller turns it
    into a WorkerError."""

    def __init__(self, rank: int, *, exit_code: int | None = None, signal_name: str | None = None,
                 node_lost: str | None = None, cause: str | None = None, engine: str = "local") -> None:
        if node_lost is not None:
            how = f"was lost with its node ({node_lost})"
        elif cause is not None:
            how = f"died: {cause}"
        elif signal_name is not None:
            how = f"was killed by {signal_name}"
        else:
            how = f"exited with code {exit_code} without reporting an error"
        super().__init__(f"worker rank {rank} (of the {engine} engine) {how}")
        self.rank = rank
        self.exit_code = exit_code
        self.signal_name = signal_name
        self.node_lost = node_lost
        self.cause = cause

    @property
    def violent(self) -> bool:
        """Killed (a signal, the OOM killer, an engine's verdict) or lost with its node, rather
        than exiting: when its peers fail at the same moment, this is the root cause of their
        errors."""
        return self.signal_name is not None or self.node_lost is not None or self.cause is not None


class StorageNotSharedError(StorageError):
    """A worker (or a sweep's trial driver) on another node does not see the run directory
    (or the sweep) the driver wrote: the storage path is not shared by every node."""

    HINT = ("Hint: every node must see the same storage at the same path: a shared file system (NFS) "
            "mounted at the same place, or an object store (s3://...) for RunConfig(storage_path=...)")


class VersionMismatchError(UnbrokenError, RuntimeError):
    """A node runs other versions of Python, torch or unbroken than the driver."""


class MissingDependencyError(UnbrokenError, ImportError):
    """An optional package that the asked-for feature needs is not installed; the message
    names the extra to install."""
