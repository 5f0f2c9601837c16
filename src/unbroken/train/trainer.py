"""Trainers: BaseTrainer (fit, restore, can_restore) and DataParallelTrainer."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

from unbroken.core.codec import bind_init_args, qualified_name
from unbroken.core.config import RunConfig, ScalingConfig, generated_name
from unbroken.core.run_spec import RunSpec
from unbroken.core.validation_config import ValidationConfig
from unbroken.errors import CorruptRunError, RunNotFoundError, SchemaVersionError
from unbroken.execution.controller import Controller
from unbroken.execution.engine.factory import capacity_probe, make_worker_group
from unbroken.execution.recovery.failure_policy import FailurePolicy
from unbroken.execution.validations import validation_runner
from unbroken.observe.progress import ProgressReporter
from unbroken.run import restore as rs
from unbroken.run.callbacks import CallbackList
from unbroken.run.result import Result
from unbroken.store import manifest as mf
from unbroken.store.checkpoint import Checkpoint
from unbroken.store.pickled import SavedPickles
from unbroken.store.storage import Storage, split_run_url
from unbroken.train.open_run import open_run, restore_hint
from unbroken.worker import session as _session
from unbroken.worker.backend import Backend

log = logging.getLogger("unbroken")

T = TypeVar("T", bound="BaseTrainer")


class BaseTrainer:
    """A restorable training job. Subclasses implement `training_loop()`, which runs in each
    worker process, and may take any constructor arguments: they are saved with the run,
    and `restore(path, **overrides)` accepts exactly those names."""

    _run_spec: RunSpec = RunSpec()  # where a subclass's own __init__ leaves it unset

    def __new__(cls, *args: Any, **kwargs: Any) -> BaseTrainer:
        self = super().__new__(cls)
        try:
            self._init_args = bind_init_args(cls, args, kwargs)
        except TypeError:
            self._init_args = {}  # __init__ reports the bad call itself (or unpickling fills it)
        return self

    @property
    def init_args(self) -> dict[str, Any]:
        """The constructor's arguments by name, as the trainer was made: what the run saves,
        what its identity is computed from, and what `restore(path, **overrides)` accepts."""
        return self._init_args

    def __init__(self, *, scaling_config: ScalingConfig | None = None, run_config: RunConfig | None = None,
                 datasets: dict[str, Any] | None = None,
                 resume_from_checkpoint: Checkpoint | None = None) -> None:
        self.scaling_config = _check_type("scaling_config", scaling_config, ScalingConfig) or ScalingConfig()
        run_config = _check_type("run_config", run_config, RunConfig) or RunConfig()
        self.run_spec = RunSpec(name_generated=not run_config.name)
        if self.run_spec.name_generated:
            run_config = dataclasses.replace(run_config, name=generated_name(type(self).__name__))
        self.run_config = run_config
        self.datasets = dict(datasets or {})
        self.resume_from_checkpoint = _check_type("resume_from_checkpoint", resume_from_checkpoint,
                                                  Checkpoint)

    def training_loop(self) -> None:
        """The work each worker does; call train.report inside it."""
        raise NotImplementedError(f"{type(self).__name__} must implement training_loop()")

    @property
    def run_spec(self) -> RunSpec:
        """What fit() is asked to do beyond the constructor's arguments (`core.run_spec`): the
        constructor, restore() and a sweep set it; opening the run, the controller and each
        rank's payload read it. Nothing else carries that intent."""
        return self._run_spec

    @run_spec.setter
    def run_spec(self, spec: RunSpec) -> None:
        if not isinstance(spec, RunSpec):
            raise TypeError(f"run_spec must be a RunSpec, got {type(spec).__name__}")
        self._run_spec = spec

    def _backend(self) -> Backend:
        return Backend()

    # -- driver side ----------------------------------------------------------------------
    def fit(self) -> Result:
        """Train to the end and return the Result; resumes the run if it already exists.

        Raises TrainingFailedError (with the restore call in its message) when it cannot finish.
        """
        started = time.time()
        callbacks = _callbacks(self.run_config)  # checks them before anything is written
        run, finished = open_run(self)
        if finished is not None:
            return finished
        run.fit_started_at = started
        try:
            done = run.finished_at_stop(self.run_config.stop)
        except BaseException:
            run.lease.release()  # e.g. no checkpoint verifies: nothing was changed, and the run is free
            raise
        if done:
            return Result.from_path(run.path, self.run_config.storage_filesystem)
        hint = restore_hint(type(self), run.path)
        run.callbacks = callbacks.bind(run)
        Controller(self, run, hint, group_factory=make_worker_group,
                   failure_policy=FailurePolicy(self.run_config.failure_config),
                   validation_runner=validation_runner(self.scaling_config),
                   capacity=capacity_probe(self.scaling_config) if self.scaling_config.elasticity_enabled
                   else None).execute()
        # The overrides are applied now: a second fit() returns the stored result.
        self.run_spec = self.run_spec.replace(overrides=frozenset())
        return Result.from_path(run.path, self.run_config.storage_filesystem)

    @classmethod
    def restore(cls: type[T], path: str | os.PathLike, *, allow_pickle: bool = True,
                storage_filesystem: Any = None, **overrides: Any) -> T:
        """Rebuild the trainer saved in the run at `path`; its fit() continues the run.

        Any constructor argument may be re-specified by name; a re-specified argument's
        stored copy is never loaded. Called on BaseTrainer, returns whatever class was saved.
        Arguments that are not re-specified and were stored pickled are unpickled, and
        unpickling can run code: `allow_pickle=False` unpickles nothing, and raises
        PickleRefusedError, naming the arguments to re-specify, where something would have to
        be unpickled. (`allow_pickle` is restore's own keyword, not a constructor argument.)
        `storage_filesystem` (Ray V1's keyword): the fsspec filesystem `path` is on, where its
        URL does not say (a custom filesystem); the run's saved RunConfig keeps its own.
        """
        path = os.fspath(path)
        run_config = overrides.get("run_config")
        filesystem = storage_filesystem or getattr(run_config, "storage_filesystem", None)
        storage = Storage.from_url(path, filesystem)
        manifest = mf.load(storage)
        url = storage.url()
        pickles = SavedPickles.of_run(storage, manifest, allow=allow_pickle)
        if not allow_pickle:
            rs.check_trainer_pickles(pickles, manifest, cls, overrides, url)
        target = rs.resolve_class(pickles, manifest, cls, url)
        args = rs.load_init_args(pickles, manifest, target, overrides, url)
        saved_config = args.get("run_config") or RunConfig()
        storage_path, name = split_run_url(url)
        args["run_config"] = dataclasses.replace(saved_config, name=name, storage_path=storage_path)
        trainer = target(**args)
        trainer._init_args.update({"run_config": saved_config})
        trainer.run_spec = RunSpec(restored_from=url, overrides=frozenset(overrides), loaded_fingerprints={
            name: fp for name, fp in manifest.code_fingerprints.items() if name not in overrides})
        return trainer

    @classmethod
    def can_restore(cls, path: str | os.PathLike, storage_filesystem: Any = None) -> bool:
        """True if `path` holds a run this class (or a subclass) can restore."""
        try:
            storage = Storage.from_url(os.fspath(path), storage_filesystem)
            manifest = mf.load(storage)
        except (RunNotFoundError, CorruptRunError, SchemaVersionError, OSError):
            return False
        return qualified_name(cls) in manifest.trainer_mro


class DataParallelTrainer(BaseTrainer):
    """Runs `train_loop_per_worker(config)` on `scaling_config.num_workers` workers."""

    def __init__(self, train_loop_per_worker: Callable[..., None], *,
                 train_loop_config: dict[str, Any] | None = None,
                 scaling_config: ScalingConfig | None = None, run_config: RunConfig | None = None,
                 datasets: dict[str, Any] | None = None,
                 resume_from_checkpoint: Checkpoint | None = None, backend_config: Any = None,
                 validation_config: ValidationConfig | None = None) -> None:
        if not callable(train_loop_per_worker):
            raise TypeError(f"train_loop_per_worker must be a function, got {train_loop_per_worker!r}")
        super().__init__(scaling_config=scaling_config, run_config=run_config, datasets=datasets,
                         resume_from_checkpoint=resume_from_checkpoint)
        self.train_loop_per_worker = train_loop_per_worker
        self.train_loop_config = train_loop_config
        self.backend_config = backend_config
        # Validates the checkpoints a report asks for (`train.report(..., validation=True)`).
        self.validation_config = _check_type("validation_config", validation_config, ValidationConfig)

    def training_loop(self) -> None:
        value = self._call_train_loop()
        _session.current("training_loop()").save_return_value(value)  # Result.return_value

    def _call_train_loop(self) -> Any:
        """Call `train_loop_per_worker` (with the config, unless it takes no argument); returns
        what it returns."""
        fn = self.train_loop_per_worker
        if len(inspect.signature(fn).parameters) == 0:
            return fn()
        return fn(self.train_loop_config if self.train_loop_config is not None else {})

    def _backend(self) -> Backend:
        return self.backend_config.make_backend() if self.backend_config is not None else Backend()


def _callbacks(run_config: RunConfig) -> CallbackList:
    """The user's callbacks plus the progress display that `run_config.verbose` asks for."""
    callbacks = list(run_config.callbacks or [])
    if run_config.verbose >= 1:
        callbacks.append(ProgressReporter(run_config))
    return CallbackList(callbacks)


def _check_type(name: str, value: Any, kind: type) -> Any:
    if value is not None and not isinstance(value, kind):
        raise TypeError(f"{name} must be a {kind.__name__}, got {type(value).__name__}")
    return value
