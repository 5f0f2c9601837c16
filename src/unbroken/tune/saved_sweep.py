"""A sweep's saved Tuner arguments: encoding them when the sweep is created or continued,
loading each back on its own (and only when needed) for `Tuner.restore`, and the checks a
restore makes against what was saved.

The encoding is a run's (`core.codec.encode_or_pickle`); a Trainer trainable is saved as
a run saves its trainer (`run.restore.encode_trainer`), and its pickles are read back the
same way (`run.restore.resolve_class`, `load_init_args`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from unbroken import __version__
from unbroken.core.codec import decode, describe, encode_or_pickle, qualified_name
from unbroken.core.config import RunConfig
from unbroken.errors import (
    PickleRefusedError,
    RestoreArgumentError,
    RunNotFoundError,
    SweepMismatchError,
    TrainerClassMismatchError,
)
from unbroken.run.identity import identity_diff
from unbroken.run.restore import encode_trainer, load_init_args, load_pickled, pickles_needed, resolve_class
from unbroken.store import manifest as mf
from unbroken.store import sweep_manifest as sw
from unbroken.store.pickled import SavedPickles, pickled_files, refuse_pickles, replace_pickles
from unbroken.store.storage import Storage, split_run_url
from unbroken.train.trainer import BaseTrainer
from unbroken.tune import search_space as ss
from unbroken.tune.callback import split
from unbroken.tune.callback_state import check_matches, pickled_names
from unbroken.tune.function_trainable import FunctionTrainable
from unbroken.tune.trial import check_trainable, trainable_name
from unbroken.tune.tune_config import TuneConfig


@dataclass
class SavedTuner:
    """A Tuner's arguments encoded for storage: sweep.json's params, the Tuner's pickles, the
    trainable's record and, for a Trainer trainable, its pickled arguments."""

    params: dict[str, Any]
    pickles: dict[str, bytes]
    trainable: dict[str, Any]
    trainer_pickles: dict[str, bytes] | None


def encode_tuner(tuner: Any) -> SavedTuner:
    """Encode without writing anything; raises UnsavableArgumentError naming what cannot be saved."""
    params: dict[str, Any] = {"param_space": {}, "param_space_keys": list(tuner.param_space)}
    try:  # lets Tuner.restore(param_space=...) check the new one without unpickling the old one
        params["param_space_shape"] = shape_json(tuner.param_space)
    except (TypeError, ValueError):
        pass
    pickles: dict[str, bytes] = {}
    for key, value in tuner.param_space.items():
        encode_or_pickle(value, f"param_space[{key!r}] of the Tuner", params["param_space"], pickles, key,
                            f"param_space/{key}")
    for name in ("tune_config", "run_config"):
        encode_or_pickle(getattr(tuner, name), f"{name} of the Tuner", params, pickles, name)
    t = tuner.trainable
    if isinstance(t, BaseTrainer):
        saved = encode_trainer(type(t), t.init_args)
        return SavedTuner(params, pickles, {"kind": "trainer", "name": type(t).__name__, **saved.fields},
                        saved.pickles)
    record: dict[str, Any] = {"kind": "function", "name": trainable_name(t)}
    if isinstance(t, FunctionTrainable) and t.parameters:  # never saved: a restore takes them again
        record["parameters"] = sorted(t.parameters)
        t = t.without_parameters()
    encode_or_pickle(t, "the Tuner's trainable", params, pickles, "trainable")
    return SavedTuner(params, pickles, record, None)


def write_tuner(storage: Storage, manifest: sw.SweepManifest, saved: SavedTuner) -> None:
    """Write the pickled Tuner arguments and a Trainer trainable's pickled arguments, one file
    each, and fill the manifest (saved by the caller); `manifest` is still the one on storage."""
    replace_pickles(storage, manifest.schema_version, sw.TUNER_PICKLED, saved.pickles,
                    manifest.pickled_params, sw.LEGACY_TUNER_PKL)
    replace_pickles(storage, manifest.schema_version, sw.TRAINABLE_PICKLED, saved.trainer_pickles or {},
                    manifest.trainable.get("pickled_params", []), sw.LEGACY_TRAINER_PKL)
    manifest.params, manifest.pickled_params = saved.params, sorted(saved.pickles)
    manifest.trainable = saved.trainable
    manifest.schema_version, manifest.package_version = sw.SCHEMA_VERSION, __version__


def shape_json(space: dict[str, Any]) -> dict[str, Any]:
    """The param_space's shape (search_space.shape) as it reads back from JSON."""
    return json.loads(json.dumps(ss.shape(space), default=repr))


# -- loading it back ------------------------------------------------------------------------------
class SavedSweep:
    """The saved Tuner arguments of a sweep, each decoded or unpickled on its own, and only
    when needed (with allow=False, never unpickled)."""

    def __init__(self, storage: Storage, manifest: sw.SweepManifest, path: str, allow: bool = True) -> None:
        self.storage, self.manifest, self.path = storage, manifest, path
        legacy = not pickled_files(manifest.schema_version)
        self.pickles = SavedPickles(storage, sw.TUNER_PICKLED, sw.LEGACY_TUNER_PKL if legacy else None,
                                       allow)
        self.trainer_pickles = SavedPickles(storage, sw.TRAINABLE_PICKLED,
                                               sw.LEGACY_TRAINER_PKL if legacy else None, allow)

    @classmethod
    def open(cls, path: str | os.PathLike, storage_filesystem: Any, allow: bool) -> SavedSweep:
        """The saved arguments of the sweep at `path`; RunNotFoundError or NotASweepError when
        there is none."""
        storage = Storage.from_url(os.fspath(path), storage_filesystem)
        if not sw.is_sweep_dir(storage):
            if not storage.exists():
                raise RunNotFoundError(f"no sweep at {storage.url()!r}: the path does not exist. Hint: a "
                                       "sweep is <storage_path>/<RunConfig name>")
            raise sw.not_a_sweep(storage)
        return cls(storage, sw.load(storage), storage.url(), allow)

    def trainable_or(self, given: Any) -> Any:
        """`given` (checked to be the kind of trainable the sweep was started with), or the saved one."""
        if given is None:
            return self.trainable()
        check_trainable_matches(self.manifest, given, self.path)
        return given

    def param_space_or(self, given: dict[str, Any] | None) -> dict[str, Any]:
        """`given` (checked to keep the saved keys and search domains), or the saved param_space."""
        if given is None:
            return self.param_space()
        check_same_shape(self.param_space_shape(), given, self.path)
        return given

    def tune_config_or(self, given: TuneConfig | None) -> TuneConfig:
        """The saved TuneConfig, amended by `given` where a restore may change it."""
        saved = self.tune_config()
        return saved if given is None else amend_tune_config(saved, given, self.manifest, self.path)

    def run_config_or(self, given: RunConfig | None, storage_filesystem: Any) -> RunConfig:
        """`given`, else the saved RunConfig (or a default one), with the name and storage path
        of the sweep's directory."""
        rc = given if given is not None else (self.run_config() or RunConfig())
        if not isinstance(rc, RunConfig):
            raise TypeError(f"run_config must be a RunConfig, got {type(rc).__name__}")
        check_matches(self.manifest.callback_states, split(rc.callbacks)[0], self.path)  # before any write
        storage_path, name = split_run_url(self.path)
        return dataclasses.replace(rc, name=name, storage_path=storage_path,
                                   storage_filesystem=storage_filesystem or rc.storage_filesystem)

    def _blob(self, name: str, hint: str) -> Any:
        return load_pickled(self.pickles, name, f"{name} saved with the sweep at {self.path!r}",
                            f"Tuner.restore({self.path!r}, {hint})")

    def check_pickles(self, trainable_given: bool, space_given: bool, run_config_given: bool) -> None:
        """For Tuner.restore(allow_pickle=False): PickleRefusedError, before anything is
        unpickled, if restoring would unpickle anything."""
        m = self.manifest
        what, respecify, notes = [], [], []
        if not trainable_given:
            t = m.trainable
            if t.get("parameters"):
                self.trainable()  # raises: its parameters were not saved
            if t.get("kind") == "function":
                needed = "trainable" in m.pickled_params
            else:
                args, cls_needed = pickles_needed(self.trainer_pickles, self._trainer_manifest(),
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
        if pickled_names(m.callback_states):
            what.append("the saved state of a sweep callback")
            notes.append("a sweep callback whose get_state() returns plain data is saved as JSON")
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
            return decode(self.manifest.params[slot])
        except (ImportError, AttributeError, TypeError) as e:
            raise RestoreArgumentError(
                f"{slot} saved with the sweep at {self.path!r} can no longer be loaded "
                f"({type(e).__name__}: {e}). Hint: re-specify it: "
                f"Tuner.restore({self.path!r}, {hint})") from None

    def trainable(self) -> Any:
        t = self.manifest.trainable
        hint = "trainable=..."
        if t.get("parameters"):
            given = ", ".join(f"{name}=..." for name in t["parameters"])
            raise RestoreArgumentError(
                f"the trainable {t.get('name')!r} of the sweep at {self.path!r} was given objects with "
                f"tune.with_parameters ({', '.join(t['parameters'])}), which are never saved. Hint: pass "
                f"it again: Tuner.restore({self.path!r}, trainable=tune.with_parameters({t.get('name')}, "
                f"{given}))")
        if t.get("kind") == "function":
            if "trainable" in self.manifest.params:
                return self._decode("trainable", hint)
            return self._blob("trainable", hint)
        saved = self._trainer_manifest()
        try:
            cls = resolve_class(self.trainer_pickles, saved, BaseTrainer, self.path)
            return cls(**load_init_args(self.trainer_pickles, saved, cls, {}, self.path))
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
                space[key] = decode(params["param_space"][key])
            else:
                space[key] = self._blob(f"param_space/{key}", "param_space={...}")
        return space

    def param_space_shape(self) -> dict[str, Any]:
        """The saved param_space's shape: stored as JSON since schema 2, else computed."""
        stored = self.manifest.params.get("param_space_shape")
        return stored if isinstance(stored, dict) else shape_json(self.param_space())

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
def check_identity(manifest: sw.SweepManifest, identity: dict[str, Any], path: str) -> None:
    lines = identity_diff(manifest.identity, identity)
    if not lines:
        return
    diff = "\n".join(lines)
    raise SweepMismatchError(
        f"the sweep at {path!r} was started with a different configuration:\n{diff}\n"
        f"Hint: to extend it with more samples on purpose, call Tuner.restore({path!r}, trainable, "
        "tune_config=TuneConfig(num_samples=...)).fit(); param_space values (not its keys or search "
        "domains) may be re-specified with Tuner.restore(path, trainable, param_space=...); to start a "
        "separate sweep, give RunConfig a new name.")


def check_trainable_matches(manifest: sw.SweepManifest, trainable: Any, path: str) -> None:
    check_trainable(trainable)
    saved = manifest.trainable
    if saved.get("kind") == "function" and isinstance(trainable, BaseTrainer):
        raise TrainerClassMismatchError(
            f"the sweep at {path!r} was started with the function {saved.get('name')}, not a Trainer. "
            f"Hint: Tuner.restore({path!r}, trainable={saved.get('name')})")
    if saved.get("kind") == "trainer":
        name = qualified_name(type(trainable)) if isinstance(trainable, BaseTrainer) else None
        if name != saved.get("trainer_class"):
            raise TrainerClassMismatchError(
                f"the sweep at {path!r} was started with a {saved.get('trainer_class')} trainable, not "
                f"{name or 'a function'}. Hint: Tuner.restore({path!r}, trainable={saved.get('name')}(...))")


def check_same_shape(saved: dict[str, Any], given: dict[str, Any], path: str) -> None:
    """`saved` is the saved param_space's shape (shape_json), `given` the new param_space."""
    if not isinstance(given, dict):
        raise TypeError(f"param_space must be a dict, got {type(given).__name__}")
    ss.leaves(given)
    lines = identity_diff(saved, shape_json(given))
    if lines:
        raise SweepMismatchError(
            f"Tuner.restore({path!r}, param_space=...) may re-specify values, but not change the keys or "
            "search domains of the param_space:\n" + "\n".join(lines) + "\nHint: keep the keys and "
            "domains, or start a separate sweep with a new RunConfig name")


def amend_tune_config(saved: TuneConfig, given: TuneConfig, manifest: sw.SweepManifest,
                       path: str) -> TuneConfig:
    if given.num_samples < saved.num_samples:
        raise SweepMismatchError(
            f"the sweep at {path!r} has num_samples={saved.num_samples}; a sweep can grow but not shrink "
            f"(got {given.num_samples}). Hint: TuneConfig(num_samples>={saved.num_samples})")
    out = dataclasses.replace(saved, num_samples=given.num_samples)
    if given.max_concurrent_trials is not None:
        out.max_concurrent_trials = given.max_concurrent_trials
    if given.reuse_actors is not None:
        out.reuse_actors = given.reuse_actors  # how trials run, not what they record
    if given.seed is not None and given.seed != manifest.seed:
        raise SweepMismatchError(f"the sweep at {path!r} was seeded with {manifest.seed}; got "
                                 f"seed={given.seed}. Hint: leave TuneConfig.seed unset when restoring")
    for attr in ("metric", "mode", "search_alg", "scheduler"):
        value = getattr(given, attr)
        if value is None:
            continue
        if describe(value) != describe(getattr(saved, attr)):
            raise SweepMismatchError(
                f"the sweep at {path!r} was started with TuneConfig({attr}={getattr(saved, attr)!r}); "
                f"Tuner.restore(tune_config=...) got {attr}={value!r}. Hint: only num_samples and "
                f"max_concurrent_trials may change; leave {attr} unset (None) to keep the saved one")
        setattr(out, attr, value)
    return out
