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
import json
import logging
import os
import random
import time
from typing import Any

from unbroken import __version__
from unbroken.core.config import RunConfig
from unbroken.errors import (
    PickleRefusedError,
    RestoreArgumentError,
    RunExistsError,
    RunNotFoundError,
    SweepMismatchError,
    TrainerClassMismatchError,
)
from unbroken.execution.engine.factory import check_can_run
from unbroken.run import restore as rs
from unbroken.store import manifest as mf
from unbroken.store import opening
from unbroken.store import sweep_manifest as sw
from unbroken.store.pickled import SavedPickles, pickled_files, refuse_pickles, write_pickles
from unbroken.store.storage import Storage, split_run_url
from unbroken.train.trainer import BaseTrainer
from unbroken.tune import search_space as ss
from unbroken.tune.asha import ASHAScheduler
from unbroken.tune.result_grid import ResultGrid
from unbroken.tune.schedulers import FIFOScheduler
from unbroken.tune.search.basic_variant import BasicVariantGenerator
from unbroken.tune.search.searcher import Searcher
from unbroken.tune.sweep_driver import ResumeFlags, SweepDriver, reconciled
from unbroken.tune.trial import check_param_space_keys, check_trainable, cpus_per_trial, trainable_name
from unbroken.tune.tune_config import TuneConfig

log = logging.getLogger("unbroken")

# What is particular to sweeps in opening one (see unbroken.store.opening).
SWEEP = opening.Kind(noun="sweep", load=sw.load, first_files=frozenset(),
                     first_meta=frozenset({"lease.json", "pickled", "tuner.pkl", "trainer.pkl"}))


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
        if not run_config.name:
            name = f"{trainable_name(trainable)}_{time.strftime('%Y-%m-%d_%H-%M-%S')}"
            run_config = dataclasses.replace(run_config, name=name)
        self.run_config = run_config
        self._searcher = _searcher(self.tune_config)
        self._scheduler = _scheduler(self.tune_config)
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
        path = storage.url()
        saved = _encode(self)  # fails now if an argument cannot be saved
        if isinstance(self.trainable, BaseTrainer):
            check_can_run(self.trainable.scaling_config)  # e.g. use_gpu=True where no GPU is visible
        total = self._searcher.total(self.param_space, tc.num_samples)
        self._searcher.check(storage, self.metric, self.mode)
        identity = self._identity()

        exists = sw.is_sweep_dir(storage)
        if not exists and mf.is_run_dir(storage):
            raise RunExistsError(f"{path!r} is a single run, not a sweep; it is left untouched. "
                                 "Hint: give the Tuner's RunConfig another name")
        manifest = opening.existing(SWEEP, storage, exists=exists, restored=restored, resume=rc.resume,
                                    check_identity=lambda m: _check_identity(m, identity, path))
        if manifest is not None and self._nothing_to_do(storage, manifest, total):
            log.info("sweep %s has nothing left to run; returning its stored results", path)
            return None

        with opening.leased(SWEEP, storage, manifest, self._new_manifest,
                            on_failure=self._searcher.close) as (lease, manifest, previous):
            _write(storage, manifest, saved)
            manifest.identity = identity
            manifest.searcher = self._searcher.describe()
            manifest.scheduler = self._scheduler.describe() if self._scheduler is not None else None
            manifest.num_samples, manifest.total_trials = tc.num_samples, total
            manifest.max_concurrent_trials = tc.max_concurrent_trials
            driver = SweepDriver(
                storage=storage, manifest=manifest, previous=previous, lease=lease, trainable=self.trainable,
                space=self.param_space, run_config=rc, searcher=self._searcher, scheduler=self._scheduler,
                metric=self.metric, mode=self.mode, concurrency=self._concurrency(total), total=total,
                verbose=rc.verbose)
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

    def _concurrency(self, total: int) -> int:
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
        by_cpus = max(1, int(cpus // cpus_per_trial(self.trainable)))
        wanted = self.tune_config.max_concurrent_trials or by_cpus
        if wanted > by_cpus:
            log.info("sweep %s: max_concurrent_trials=%d, but %d CPU(s) fit only %d trial(s) at once",
                     self.run_config.name, wanted, cpus, by_cpus)
        return max(1, min(wanted, by_cpus, max(total, 1)))

    def _seed(self) -> tuple[int, bool]:
        given = self._seed_given()
        if given is not None:
            return int(given), True
        return random.SystemRandom().randrange(2 ** 31), False

    def _identity(self) -> dict[str, Any]:
        """What makes a sweep this sweep (compared on auto-resume)."""
        tc, t = self.tune_config, self.trainable
        ident: dict[str, Any] = {
            "trainable": (rs.identity(type(t), t._init_args) if isinstance(t, BaseTrainer)
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
          its `max_concurrent_trials` replaces the saved one; its other settings must be
          None or equal to the saved ones;
        - `run_config` replaces the saved RunConfig (name and storage_path still come from `path`);
        - `allow_pickle=False` unpickles nothing stored with the sweep (unpickling can run code):
          where something would have to be unpickled, PickleRefusedError names what to
          re-specify (`trainable`, `param_space`, `run_config`).
        """
        storage = Storage.from_url(os.fspath(path), storage_filesystem)
        if not sw.is_sweep_dir(storage):
            if not storage.exists():
                raise RunNotFoundError(f"no sweep at {storage.url()!r}: the path does not exist. Hint: a "
                                       "sweep is <storage_path>/<RunConfig name>")
            raise sw.not_a_sweep(storage)
        manifest = sw.load(storage)
        url = storage.url()
        loader = _Saved(storage, manifest, url, allow_pickle)
        if not allow_pickle:
            loader.check_pickles(trainable is not None, param_space is not None, run_config is not None)
        if trainable is None:
            trainable = loader.trainable()
        else:
            _check_trainable_matches(manifest, trainable, url)
        if param_space is not None:
            _check_same_shape(loader.param_space_shape(), param_space, url)
            space = param_space
        else:
            space = loader.param_space()
        tc = loader.tune_config()
        if tune_config is not None:
            tc = _amend_tune_config(tc, tune_config, manifest, url)
        rc = run_config if run_config is not None else (loader.run_config() or RunConfig())
        if not isinstance(rc, RunConfig):
            raise TypeError(f"run_config must be a RunConfig, got {type(rc).__name__}")
        storage_path, name = split_run_url(url)
        rc = dataclasses.replace(rc, name=name, storage_path=storage_path,
                                 storage_filesystem=storage_filesystem or rc.storage_filesystem)
        tuner = cls(trainable, param_space=space, tune_config=tc, run_config=rc)
        tuner._restored_from = url
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


def _scheduler(tc: TuneConfig) -> ASHAScheduler | None:
    sched = tc.scheduler
    if sched is None or isinstance(sched, FIFOScheduler):
        return None
    if not isinstance(sched, ASHAScheduler):
        raise TypeError(f"TuneConfig.scheduler must be ASHAScheduler or FIFOScheduler from "
                        f"unbroken.tune.schedulers, got {type(sched).__name__}")
    return sched


def _metric_mode(tc: TuneConfig, searcher: Searcher, scheduler: ASHAScheduler | None
                 ) -> tuple[str | None, str | None]:
    metric, mode = tc.metric, tc.mode
    for owner in (searcher, scheduler):
        for attr in ("metric", "mode"):
            value = getattr(owner, attr, None)
            current = metric if attr == "metric" else mode
            if value is None:
                continue
            if current is not None and value != current:
                raise ValueError(f"{type(owner).__name__}({attr}={value!r}) disagrees with "
                                 f"TuneConfig({attr}={current!r}). Hint: set it in one place")
            if attr == "metric":
                metric = value
            else:
                mode = value
    if scheduler is not None and (metric is None or mode is None):
        raise ValueError("ASHAScheduler needs a metric and a mode. Hint: TuneConfig(metric='loss', "
                         "mode='min', scheduler=ASHAScheduler(...))")
    return metric, mode


# -- saving the Tuner's arguments -----------------------------------------------------------------
@dataclasses.dataclass
class _Encoded:
    params: dict[str, Any]
    pickles: dict[str, bytes]
    trainable: dict[str, Any]
    trainer_pickles: dict[str, bytes] | None


def _encode(tuner: Tuner) -> _Encoded:
    params: dict[str, Any] = {"param_space": {}, "param_space_keys": list(tuner.param_space)}
    try:  # lets Tuner.restore(param_space=...) check the new one without unpickling the old one
        params["param_space_shape"] = _shape(tuner.param_space)
    except (TypeError, ValueError):
        pass
    pickles: dict[str, bytes] = {}
    for key, value in tuner.param_space.items():
        rs.encode_or_pickle(value, f"param_space[{key!r}] of the Tuner", params["param_space"], pickles, key,
                            f"param_space/{key}")
    for name in ("tune_config", "run_config"):
        rs.encode_or_pickle(getattr(tuner, name), f"{name} of the Tuner", params, pickles, name)
    t = tuner.trainable
    if isinstance(t, BaseTrainer):
        saved = rs.encode_trainer(type(t), t._init_args)
        return _Encoded(params, pickles, {"kind": "trainer", "name": type(t).__name__, **saved.fields},
                        saved.pickles)
    rs.encode_or_pickle(t, "the Tuner's trainable", params, pickles, "trainable")
    return _Encoded(params, pickles, {"kind": "function", "name": trainable_name(t)}, None)


def _write(storage: Storage, manifest: sw.SweepManifest, saved: _Encoded) -> None:
    """Write the pickled Tuner arguments and a Trainer trainable's pickled arguments, one file
    each, and fill the manifest (saved by the caller); `manifest` is still the one on storage."""
    current = pickled_files(manifest.schema_version)
    keep = manifest.pickled_params if current else ()
    write_pickles(storage, sw.TUNER_PICKLED, saved.pickles, keep)
    keep = manifest.trainable.get("pickled_params", []) if current else ()
    write_pickles(storage, sw.TRAINABLE_PICKLED, saved.trainer_pickles or {}, keep)
    if current:  # left by a schema 1 sweep that has been rewritten since
        for legacy in (sw.LEGACY_TUNER_PKL, sw.LEGACY_TRAINER_PKL):
            if storage.exists(legacy):
                storage.remove(legacy)
    manifest.params, manifest.pickled_params = saved.params, sorted(saved.pickles)
    manifest.trainable = saved.trainable
    manifest.schema_version, manifest.package_version = sw.SCHEMA_VERSION, __version__


def _shape(space: dict[str, Any]) -> dict[str, Any]:
    """The param_space's shape (search_space.shape) as it reads back from JSON."""
    return json.loads(json.dumps(ss.shape(space), default=repr))


# -- loading it back ------------------------------------------------------------------------------
class _Saved:
    """The saved Tuner arguments of a sweep, each decoded or unpickled on its own, and only
    when needed (with allow=False, never unpickled)."""

    def __init__(self, storage: Storage, manifest: sw.SweepManifest, path: str, allow: bool = True) -> None:
        self.storage, self.manifest, self.path = storage, manifest, path
        legacy = not pickled_files(manifest.schema_version)
        self.pickles = SavedPickles(storage, sw.TUNER_PICKLED, sw.LEGACY_TUNER_PKL if legacy else None,
                                       allow)
        self.trainer_pickles = SavedPickles(storage, sw.TRAINABLE_PICKLED,
                                               sw.LEGACY_TRAINER_PKL if legacy else None, allow)

    def _blob(self, name: str, hint: str) -> Any:
        try:
            return self.pickles.load(name)
        except PickleRefusedError:
            raise
        except Exception as e:
            raise RestoreArgumentError(
                f"{name} saved with the sweep at {self.path!r} can no longer be loaded "
                f"({type(e).__name__}: {e}). Hint: re-specify it: "
                f"Tuner.restore({self.path!r}, {hint})") from None

    def check_pickles(self, trainable_given: bool, space_given: bool, run_config_given: bool) -> None:
        """For Tuner.restore(allow_pickle=False): PickleRefusedError, before anything is
        unpickled, if restoring would unpickle anything."""
        m = self.manifest
        what, respecify, notes = [], [], []
        if not trainable_given:
            t = m.trainable
            if t.get("kind") == "function":
                needed = "trainable" in m.pickled_params
            else:
                args, cls_needed = rs.pickles_needed(self.trainer_pickles, self._trainer_manifest(),
                                                     BaseTrainer, {})
                needed = bool(args) or cls_needed
            if needed:
                what.append(f"the trainable {t.get('name')!r}")
                respecify.append("trainable")
        keys = [n.split("/", 1)[1] for n in m.pickled_params if n.startswith("param_space/")]
        if keys and not (space_given and isinstance(m.params.get("param_space_shape"), dict)):
            what.append(f"the param_space value{'s' if len(keys) > 1 else ''} {', '.join(map(repr, keys))}")
            if space_given:
                notes.append("this sweep was saved by an older unbroken, which needs the saved param_space "
                             "to check the new one's keys and search domains")
            else:
                respecify.append("param_space")
        if "tune_config" in m.pickled_params:
            what.append("the tune_config")
            notes.append("tune_config cannot be re-specified whole (Tuner.restore(tune_config=...) amends "
                         "the saved one)")
        if "run_config" in m.pickled_params and not run_config_given:
            what.append("the run_config")
            respecify.append("run_config")
        call = f"Tuner.restore({self.path!r}{', trainable' if trainable_given else ''}, allow_pickle=False)"
        refuse_pickles(what, self.path, call, respecify, "; ".join(notes), kind="sweep")

    def _trainer_manifest(self) -> mf.RunManifest:
        t = self.manifest.trainable
        return mf.RunManifest(name=self.manifest.name, trainer_class=t["trainer_class"],
                              trainer_mro=t["trainer_mro"], params=t["params"],
                              pickled_params=t["pickled_params"], must_respecify=t["must_respecify"],
                              dataset_names=t["dataset_names"])

    def _decode(self, slot: str, hint: str) -> Any:
        try:
            return rs.decode(self.manifest.params[slot])
        except (ImportError, AttributeError, TypeError) as e:
            raise RestoreArgumentError(
                f"{slot} saved with the sweep at {self.path!r} can no longer be loaded "
                f"({type(e).__name__}: {e}). Hint: re-specify it: "
                f"Tuner.restore({self.path!r}, {hint})") from None

    def trainable(self) -> Any:
        t = self.manifest.trainable
        hint = "trainable=..."
        if t.get("kind") == "function":
            if "trainable" in self.manifest.params:
                return self._decode("trainable", hint)
            return self._blob("trainable", hint)
        saved = self._trainer_manifest()
        try:
            cls = rs.resolve_class(self.trainer_pickles, saved, BaseTrainer, self.path)
            return cls(**rs.load_init_args(self.trainer_pickles, saved, cls, {}, self.path))
        except PickleRefusedError:
            raise
        except RestoreArgumentError as e:
            raise RestoreArgumentError(
                f"the {t.get('name')} trainable saved with the sweep at {self.path!r} cannot be rebuilt: "
                f"{str(e).split(' Hint:')[0]} Hint: pass it again: Tuner.restore({self.path!r}, "
                f"trainable={t.get('name')}(...))") from None

    def param_space(self) -> dict[str, Any]:
        params = self.manifest.params
        space = {}
        for key in params.get("param_space_keys", list(params.get("param_space", {}))):
            if key in params.get("param_space", {}):
                space[key] = rs.decode(params["param_space"][key])
            else:
                space[key] = self._blob(f"param_space/{key}", "param_space={...}")
        return space

    def param_space_shape(self) -> dict[str, Any]:
        """The saved param_space's shape: stored as JSON since schema 2, else computed."""
        stored = self.manifest.params.get("param_space_shape")
        return stored if isinstance(stored, dict) else _shape(self.param_space())

    def tune_config(self) -> TuneConfig:
        if "tune_config" in self.manifest.params:
            return self._decode("tune_config", "tune_config=TuneConfig(...)")
        return self._blob("tune_config", "tune_config=TuneConfig(...)")

    def run_config(self) -> RunConfig | None:
        if "run_config" in self.manifest.params:
            return self._decode("run_config", "run_config=RunConfig(...)")
        if "run_config" in self.manifest.pickled_params:
            return self._blob("run_config", "run_config=RunConfig(...)")
        return None


# -- restore checks -------------------------------------------------------------------------------
def _check_identity(manifest: sw.SweepManifest, identity: dict[str, Any], path: str) -> None:
    lines = rs.identity_diff(manifest.identity, identity)
    if not lines:
        return
    diff = "\n".join(lines)
    raise SweepMismatchError(
        f"the sweep at {path!r} was started with a different configuration:\n{diff}\n"
        f"Hint: to extend it with more samples on purpose, call Tuner.restore({path!r}, trainable, "
        "tune_config=TuneConfig(num_samples=...)).fit(); param_space values (not its keys or search "
        "domains) may be re-specified with Tuner.restore(path, trainable, param_space=...); to start a "
        "separate sweep, give RunConfig a new name.")


def _check_trainable_matches(manifest: sw.SweepManifest, trainable: Any, path: str) -> None:
    check_trainable(trainable)
    saved = manifest.trainable
    if saved.get("kind") == "function" and isinstance(trainable, BaseTrainer):
        raise TrainerClassMismatchError(
            f"the sweep at {path!r} was started with the function {saved.get('name')}, not a Trainer. "
            f"Hint: Tuner.restore({path!r}, trainable={saved.get('name')})")
    if saved.get("kind") == "trainer":
        name = rs.qualified_name(type(trainable)) if isinstance(trainable, BaseTrainer) else None
        if name != saved.get("trainer_class"):
            raise TrainerClassMismatchError(
                f"the sweep at {path!r} was started with a {saved.get('trainer_class')} trainable, not "
                f"{name or 'a function'}. Hint: Tuner.restore({path!r}, trainable={saved.get('name')}(...))")


def _check_same_shape(saved: dict[str, Any], given: dict[str, Any], path: str) -> None:
    """`saved` is the saved param_space's shape (_shape), `given` the new param_space."""
    if not isinstance(given, dict):
        raise TypeError(f"param_space must be a dict, got {type(given).__name__}")
    ss.leaves(given)
    lines = rs.identity_diff(saved, _shape(given))
    if lines:
        raise SweepMismatchError(
            f"Tuner.restore({path!r}, param_space=...) may re-specify values, but not change the keys or "
            "search domains of the param_space:\n" + "\n".join(lines) + "\nHint: keep the keys and "
            "domains, or start a separate sweep with a new RunConfig name")


def _amend_tune_config(saved: TuneConfig, given: TuneConfig, manifest: sw.SweepManifest,
                       path: str) -> TuneConfig:
    if given.num_samples < saved.num_samples:
        raise SweepMismatchError(
            f"the sweep at {path!r} has num_samples={saved.num_samples}; a sweep can grow but not shrink "
            f"(got {given.num_samples}). Hint: TuneConfig(num_samples>={saved.num_samples})")
    out = dataclasses.replace(saved, num_samples=given.num_samples)
    if given.max_concurrent_trials is not None:
        out.max_concurrent_trials = given.max_concurrent_trials
    if given.seed is not None and given.seed != manifest.seed:
        raise SweepMismatchError(f"the sweep at {path!r} was seeded with {manifest.seed}; got "
                                 f"seed={given.seed}. Hint: leave TuneConfig.seed unset when restoring")
    for attr in ("metric", "mode", "search_alg", "scheduler"):
        value = getattr(given, attr)
        if value is None:
            continue
        if rs.describe(value) != rs.describe(getattr(saved, attr)):
            raise SweepMismatchError(
                f"the sweep at {path!r} was started with TuneConfig({attr}={getattr(saved, attr)!r}); "
                f"Tuner.restore(tune_config=...) got {attr}={value!r}. Hint: only num_samples and "
                f"max_concurrent_trials may change; leave {attr} unset (None) to keep the saved one")
        setattr(out, attr, value)
    return out
