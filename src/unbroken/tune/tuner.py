"""Tuner: fit, restore and can_restore for sweeps.

A sweep is `<storage_path>/<RunConfig name>/`, with `.unbroken/sweep.json` (the manifest),
`.unbroken/pickled/tuner/` (the Tuner arguments that are not plain data, one file each),
`.unbroken/pickled/trainable/` (a Trainer trainable's non-JSON arguments, saved as a run saves
them), `.unbroken/lease.json` and one run directory per trial. The restore rules mirror a single run's:

- Running the same script again resumes the sweep (`RunConfig.resume="auto"`), once its
  identity (trainable kind, param_space, num_samples, metric, mode, search algorithm,
  scheduler, an explicit seed) matches; otherwise SweepMismatchError shows the difference
  and the ways out. max_concurrent_trials and the RunConfig settings may change.
- `Tuner.restore(path, trainable, ...)` continues a sweep on purpose, and may extend it
  (`tune_config=TuneConfig(num_samples=larger)`) or re-specify param_space values (not
  its keys or search domains).
- A finished sweep returns its stored results without starting anything.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from typing import Any

from unbroken.core import supervision
from unbroken.core.config import RunConfig, generated_name
from unbroken.errors import InsufficientResourcesError, RunExistsError, RunNotFoundError
from unbroken.execution.engine.factory import check_can_run, cluster_slots, resolve_engine
from unbroken.execution.engine.local import visible_gpus
from unbroken.observe.progress import ensure_log_output
from unbroken.run.identity import identity
from unbroken.store import manifest as mf
from unbroken.store import opening
from unbroken.store import sweep_manifest as sw
from unbroken.store.storage import Storage
from unbroken.train.trainer import BaseTrainer
from unbroken.tune import search_space as ss
from unbroken.tune.asha import ASHAScheduler
from unbroken.tune.gpu_slots import GpuSlots
from unbroken.tune.hyperband import HyperBandScheduler
from unbroken.tune.pbt import PopulationBasedTraining
from unbroken.tune.reconcile import reconciled
from unbroken.tune.result_grid import ResultGrid
from unbroken.tune.saved_sweep import (
    SavedSweep,
    check_identity,
    encode_tuner,
    write_tuner,
)
from unbroken.tune.schedulers import FIFOScheduler
from unbroken.tune.search.basic_variant import BasicVariantGenerator
from unbroken.tune.search.searcher import Searcher
from unbroken.tune.sweep_driver import SweepDriver
from unbroken.tune.sweep_preparation import ResumeFlags
from unbroken.tune.trial import (
    check_param_space_keys,
    check_trainable,
    cpus_per_trial,
    trainable_name,
    trial_scaling,
)
from unbroken.tune.trial_naming import TrialNaming
from unbroken.tune.trial_slots import TrialSlots
from unbroken.tune.tune_config import TuneConfig

log = logging.getLogger("unbroken")

# What is particular to sweeps in opening one (see unbroken.store.opening).
SWEEP = opening.Kind(noun="sweep", load=sw.load, exists=sw.is_sweep_dir, first_files=frozenset(),
                     first_meta=frozenset({"lease.json", "lease.lock", "pickled", "tuner.pkl",
                                           "trainer.pkl"}))


class Tuner:
    """A hyperparameter sweep whose trials are restorable runs.

    `trainable`: a function `(config)` that calls `tune.report` and may return a final dict of
    metrics or a number (it runs as a one-worker `DataParallelTrainer`, so
    `tune.get_checkpoint` resumes it; see `trial.FunctionTrainer`), or a Trainer
    instance, whose constructor arguments each trial overrides with the param_space
    (`param_space["train_loop_config"]` is merged into its `train_loop_config`).
    """

    def __init__(self, trainable: Any, *, param_space: dict[str, Any] | None = None,
                 tune_config: TuneConfig | None = None, run_config: RunConfig | None = None) -> None:
        check_trainable(trainable)
        if param_space is not None and not isinstance(param_space, dict):
            raise TypeError(f"param_space must be a dict, got {type(param_space).__name__}")
        self.param_space: dict[str, Any] = dict(param_space or {})
        ss.leaves(self.param_space)  # refuses values it cannot sample, now
        check_param_space_keys(trainable, self.param_space)
        if tune_config is not None and not isinstance(tune_config, TuneConfig):
            raise TypeError(f"tune_config must be a TuneConfig, got {type(tune_config).__name__}")
        if run_config is not None and not isinstance(run_config, RunConfig):
            raise TypeError(f"run_config must be a RunConfig, got {type(run_config).__name__}")
        self.trainable = trainable
        self.tune_config = tune_config or TuneConfig()
        run_config = run_config or RunConfig()
        self._name_generated = not run_config.name  # then never an existing sweep's (see _storage)
        if self._name_generated:
            run_config = dataclasses.replace(run_config, name=generated_name(trainable_name(trainable)))
        self.run_config = run_config
        self._searcher = _searcher(self.tune_config)
        self._scheduler = _scheduler(self.tune_config)
        if isinstance(self._scheduler, PopulationBasedTraining):
            self._scheduler.check_space(self.param_space)
        self.metric, self.mode = _metric_mode(self.tune_config, self._searcher, self._scheduler)
        self._restored_from: str | None = None
        self._flags = ResumeFlags()

    # -- where the sweep lives --------------------------------------------------------------
    def _storage(self) -> Storage:
        rc = self.run_config
        if self._restored_from is not None:
            return Storage.from_url(self._restored_from, rc.storage_filesystem)
        root = Storage.from_url(rc.resolved_storage_path(), rc.storage_filesystem)
        return root.child(rc.name)

    @property
    def path(self) -> str:
        """The sweep directory, <storage_path>/<name>."""
        return self._storage().url()

    # -- fit --------------------------------------------------------------------------------
    def fit(self) -> ResultGrid:
        """Run the sweep's trials (resuming it if it exists) and return their results.

        Trial failures do not raise: they are in `ResultGrid.errors`. SIGTERM/SIGINT
        checkpoints and stops the running trials and raises TrainingInterruptedError with the
        restore call in its message.
        """
        if self.run_config.verbose >= 1:
            ensure_log_output()  # a sweep's progress is its log lines, in a terminal or not
        driver = self._open()
        if driver is not None:
            try:
                driver.execute()
            finally:
                driver.searcher.close()
                driver.lease.release()
            self._flags = ResumeFlags()  # applied; a second fit() returns the stored results
        return self.get_results()

    def get_results(self) -> ResultGrid:
        """The results of the sweep as they are on storage (works on a restored Tuner without fit())."""
        storage = self._storage()
        if not sw.is_sweep_dir(storage):
            if mf.is_run_dir(storage):
                raise sw.not_a_sweep(storage)
            raise RunNotFoundError(f"no sweep at {storage.url()!r} yet. Hint: call fit() first")
        manifest = sw.load(storage)
        return ResultGrid.read(storage, manifest, self.param_space, self.metric, self.mode)

    def _open(self) -> SweepDriver | None:
        """Apply the restore rules; returns the driver to run, or None when there is nothing to
        run. Raises before writing anything when the sweep must not start."""
        rc, tc = self.run_config, self.tune_config
        restored = self._restored_from is not None
        storage = self._storage()
        generated = getattr(self, "_name_generated", False) and not restored
        while generated and not opening.is_fresh_dir(SWEEP, storage):  # taken: another new name
            name = generated_name(trainable_name(self.trainable))
            rc = self.run_config = dataclasses.replace(rc, name=name)
            storage = self._storage()
        path = storage.url()
        saved = encode_tuner(self)  # fails now if an argument cannot be saved
        check_can_run(trial_scaling(self.trainable))  # e.g. use_gpu=True where no GPU is visible
        gpus = self._gpu_slots()
        total = self._searcher.total(self.param_space, tc.num_samples)
        self._searcher.check(storage, self.metric, self.mode)
        identity = self._identity()

        exists = sw.is_sweep_dir(storage)
        if not exists and mf.is_run_dir(storage):
            raise RunExistsError(f"{path!r} is a single run, not a sweep; it is left untouched. "
                                 "Hint: give the Tuner's RunConfig another name")
        manifest = opening.existing(SWEEP, storage, exists=exists, restored=restored, resume=rc.resume,
                                    check_identity=lambda m: check_identity(m, identity, path))
        if manifest is not None and self._nothing_to_do(storage, manifest, total):
            log.info("sweep %s has nothing left to run; returning its stored results", path)
            return None

        with opening.leased(SWEEP, storage, manifest, self._new_manifest,
                            on_failure=self._searcher.close) as (lease, manifest, previous):
            supervision.record(supervision.SWEEP, path)  # `unbroken run` may restart this script
            write_tuner(storage, manifest, saved)
            manifest.identity = identity
            manifest.searcher = self._searcher.describe()
            manifest.scheduler = self._scheduler.describe() if self._scheduler is not None else None
            manifest.num_samples, manifest.total_trials = tc.num_samples, total
            manifest.max_concurrent_trials = tc.max_concurrent_trials
            slots = self._trial_slots()
            on_ray = resolve_engine(trial_scaling(self.trainable)) == "ray"
            driver = SweepDriver(
                storage=storage, manifest=manifest, previous=previous, lease=lease, trainable=self.trainable,
                space=self.param_space, run_config=rc, searcher=self._searcher, scheduler=self._scheduler,
                metric=self.metric, mode=self.mode, concurrency=self._concurrency(total, slots, gpus),
                total=total, verbose=rc.verbose, slots=slots, gpus=gpus, time_budget_s=tc.time_budget_s,
                naming=TrialNaming(tc.trial_name_creator, tc.trial_dirname_creator,
                                   trainable_name(self.trainable)),
                on_ray=on_ray, reuse=bool(tc.reuse_actors) and not on_ray)
            driver.save()  # the sweep exists from here on
            driver.prepare(self._flags)
            return driver

    def _new_manifest(self, name: str) -> sw.SweepManifest:
        seed, given = self._seed()
        return sw.SweepManifest(name=name, seed=seed, seed_given=given)

    def _nothing_to_do(self, storage: Storage, manifest: sw.SweepManifest, total: int) -> bool:
        """True if fit() has no trial to run and nothing to record, whatever the flags. Decided
        on the trials as their run directories have them: a driver killed after a trial's run
        ended (ERRORED, say) but before the sweep manifest said so left it RUNNING there, and a
        status that reconciling changes must be recorded, by a driver holding the lease."""
        if len(manifest.trials) < total or manifest.status == sw.SWEEP_RUNNING:
            return False  # (RUNNING: its driver died before it recorded how the sweep ended)
        flags = self._flags
        for t in manifest.trials:
            if reconciled(storage, t, self._scheduler).status != t.status:
                return False
            if t.status in sw.UNFINISHED and flags.unfinished:
                return False
            if t.status == sw.ERROR and (flags.errored or flags.restart):
                return False
        return True

    def _trial_slots(self) -> TrialSlots | None:
        """On a Ray cluster, the rule that starts a trial only when it fits beside what the
        running trials hold (see `trial_slots`); None on the local engine."""
        scaling = trial_scaling(self.trainable)
        slots = cluster_slots(scaling)
        return None if slots is None else TrialSlots(slots, scaling.min_workers, scaling.max_workers)

    def _gpu_slots(self) -> GpuSlots | None:
        """On the local engine, when trials take GPUs: the GPUs that trials are given from."""
        scaling = trial_scaling(self.trainable)
        if resolve_engine(scaling) != "local":
            return None
        gpus = GpuSlots.of_machine(scaling, lambda: visible_gpus()[0])
        if gpus is not None and not gpus.trials:
            raise InsufficientResourcesError(
                f"each trial takes {gpus.per_trial} GPUs, and this machine's processes see "
                f"{len(gpus.free)} ({', '.join(gpus.free) or 'none'}). Hint: ask for fewer per trial, "
                "or check CUDA_VISIBLE_DEVICES")
        return gpus

    def _concurrency(self, total: int, slots: TrialSlots | None, gpus: GpuSlots | None = None) -> int:
        """How many trials run at once: max_concurrent_trials (all, by default) and a
        ConcurrencyLimiter's max_concurrent, and on the
        local engine no more than this machine's CPUs (and GPUs, when trials take them) hold
        (on a Ray cluster `slots` decides as the trials run)."""
        limit = self._searcher.max_concurrent or total  # a ConcurrencyLimiter's
        if slots is not None:
            return max(1, min(self.tune_config.max_concurrent_trials or total, total, limit))
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
        by_cpus = max(1, int(cpus // cpus_per_trial(self.trainable)))
        if gpus is not None:
            by_cpus = max(1, min(by_cpus, gpus.trials))
        wanted = self.tune_config.max_concurrent_trials or by_cpus
        if wanted > by_cpus:
            log.info("sweep %s: max_concurrent_trials=%d, but %d CPU(s) fit only %d trial(s) at once",
                     self.run_config.name, wanted, cpus, by_cpus)
        return max(1, min(wanted, by_cpus, max(total, 1), limit))

    def _seed(self) -> tuple[int, bool]:
        given = self._seed_given()
        if given is not None:
            return int(given), True
        return random.SystemRandom().randrange(2 ** 31), False

    def _identity(self) -> dict[str, Any]:
        """What makes a sweep this sweep (compared on auto-resume)."""
        tc, t = self.tune_config, self.trainable
        ident: dict[str, Any] = {
            "trainable": (identity(type(t), t.init_args) if isinstance(t, BaseTrainer)
                          else {"kind": "function"}),
            "param_space": ss.spec(self.param_space),
            "num_samples": tc.num_samples, "metric": self.metric, "mode": self.mode,
            "search_alg": self._searcher.describe(),
            "scheduler": self._scheduler.describe() if self._scheduler is not None else None,
        }
        seed = self._seed_given()
        if seed is not None:
            ident["seed"] = seed
        return ident

    def _seed_given(self) -> int | None:
        given = getattr(self._searcher, "random_state", None)
        return given if given is not None else self.tune_config.seed

    # -- restore ----------------------------------------------------------------------------
    @classmethod
    def restore(cls, path: str | os.PathLike, trainable: Any = None, resume_unfinished: bool = True,
                resume_errored: bool = False, restart_errored: bool = False,
                param_space: dict[str, Any] | None = None, tune_config: TuneConfig | None = None,
                storage_filesystem: Any = None, *, run_config: RunConfig | None = None,
                allow_pickle: bool = True) -> Tuner:
        """Rebuild the Tuner of the sweep at `path`; its fit() continues the sweep.

        - finished trials are kept; unfinished ones continue from their latest checkpoints
          (`resume_unfinished=False`: they are left as they are);
        - errored trials are skipped, resumed from their checkpoints (`resume_errored`) or
          restarted from scratch (`restart_errored`, which wins over resume_errored; the old
          run directory is kept under .unbroken/restarted/);
        - `trainable`: pass it again as Ray requires, or leave it None to load the saved one;
        - `param_space` may re-specify values (new objects, datasets) but not its keys or
          search domains;
        - `tune_config=TuneConfig(num_samples=larger)` extends the sweep on purpose;
          its `max_concurrent_trials` and `reuse_actors` replace the saved ones; its other
          settings must be None or equal to the saved ones;
        - `run_config` replaces the saved RunConfig (name and storage_path still come from `path`);
        - `allow_pickle=False` unpickles nothing stored with the sweep (unpickling can run code):
          where something would have to be unpickled, PickleRefusedError names what to
          re-specify (`trainable`, `param_space`, `run_config`).
        """
        saved = SavedSweep.open(path, storage_filesystem, allow_pickle)
        if not allow_pickle:
            saved.check_pickles(trainable is not None, param_space is not None, run_config is not None)
        tuner = cls(saved.trainable_or(trainable), param_space=saved.param_space_or(param_space),
                    tune_config=saved.tune_config_or(tune_config),
                    run_config=saved.run_config_or(run_config, storage_filesystem))
        tuner._restored_from = saved.path
        tuner._flags = ResumeFlags(unfinished=resume_unfinished, errored=resume_errored or restart_errored,
                                   restart=restart_errored)
        return tuner

    @classmethod
    def can_restore(cls, path: str | os.PathLike, storage_filesystem: Any = None) -> bool:
        """True only if `path` is the root of a sweep that can be read."""
        try:
            storage = Storage.from_url(os.fspath(path), storage_filesystem)
            if not sw.is_sweep_dir(storage):
                return False
            sw.load(storage)
        except (OSError, ValueError):
            return False
        return True


# -- tune config pieces ------------------------------------------------------------------------
def _searcher(tc: TuneConfig) -> Searcher:
    alg = tc.search_alg
    if alg is None:
        return BasicVariantGenerator()
    if not isinstance(alg, Searcher):
        raise TypeError(f"TuneConfig.search_alg must be a searcher from unbroken.tune.search "
                        f"(BasicVariantGenerator, OptunaSearch), got {type(alg).__name__}")
    return alg


def _scheduler(tc: TuneConfig) -> Any:
    sched = tc.scheduler
    if sched is None or isinstance(sched, FIFOScheduler):
        return None
    if not isinstance(sched, (ASHAScheduler, PopulationBasedTraining, HyperBandScheduler)):
        raise TypeError(f"TuneConfig.scheduler must be ASHAScheduler, HyperBandScheduler, "
                        f"PopulationBasedTraining or FIFOScheduler from unbroken.tune.schedulers, got "
                        f"{type(sched).__name__}")
    return sched


def _metric_mode(tc: TuneConfig, searcher: Searcher, scheduler: Any) -> tuple[str | None, str | None]:
    metric, mode = tc.metric, tc.mode
    for owner in (searcher, scheduler):
        for attr in ("metric", "mode"):
            value = getattr(owner, attr, None)
            current = metric if attr == "metric" else mode
            if value is None or isinstance(value, list):  # a list: a multi-objective searcher's own
                continue
            if current is not None and value != current:
                raise ValueError(f"{type(owner).__name__}({attr}={value!r}) disagrees with "
                                 f"TuneConfig({attr}={current!r}). Hint: set it in one place")
            if attr == "metric":
                metric = value
            else:
                mode = value
    if scheduler is not None and (metric is None or mode is None):
        kind = type(scheduler).__name__
        raise ValueError(f"{kind} needs a metric and a mode. Hint: TuneConfig(metric='loss', "
                         f"mode='min', scheduler={kind}(...))")
    return metric, mode
