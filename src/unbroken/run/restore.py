"""The restore rules: how a trainer's constructor arguments are saved with its run, and
how a trainer is rebuilt from a run directory.

Arguments that are plain data go into run.json as JSON. Functions importable by module
path are saved by reference. Everything else is cloudpickled *one argument at a time*,
each into its own file under `.unbroken/pickled/`, so an argument that no longer loads is
named, re-specifying it means the stored copy is never read, and nothing is unpickled
that restore() does not need (`allow_pickle=False`: nothing at all). Datasets are never
pickled. The encoding itself is `core.codec`; the run's identity is `run.identity`; opening
a run for fit() (create, auto-resume or continue) is `train.open_run`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import cloudpickle

from unbroken import __version__
from unbroken.core.codec import (
    decode,
    describe,
    encode_or_pickle,
    import_by_name,
    init_param_names,
    is_dataset_builder,
    qualified_name,
    reference,
)
from unbroken.errors import (
    PickleRefusedError,
    RestoreArgumentError,
    TrainerClassMismatchError,
    UnknownOverrideError,
)
from unbroken.run.identity import DATASETS, code_fingerprints, fingerprint, identity
from unbroken.store.manifest import SCHEMA_VERSION, RunManifest
from unbroken.store.pickled import (
    LEGACY_TRAINER_PKL,
    PICKLED_DIR,
    SavedPickles,
    refuse_pickles,
    replace_pickles,
)
from unbroken.store.storage import Storage

PARAMS_JSON = "params.json"
CLASS_ENTRY = "__trainer_class__"


@dataclass
class SavedTrainer:
    """A trainer's arguments encoded for storage: manifest fields plus per-argument pickles."""

    fields: dict[str, Any]
    pickles: dict[str, bytes]
    params_json: bytes


def encode_trainer(trainer_class: type, init_args: dict[str, Any]) -> SavedTrainer:
    """Encode without writing anything; raises TypeError naming an argument that cannot be saved."""
    params, pickles, must_respecify = {}, {}, []
    for name, value in init_args.items():
        if getattr(value, "unbroken_respecify", False):  # e.g. tune.with_parameters' objects: never saved
            must_respecify.append(name)
            continue
        if name == DATASETS and value:
            builders = {k: ds for k, ds in value.items() if is_dataset_builder(ds)}
            if len(builders) != len(value):
                must_respecify.append(name)
                continue
            value = builders
        encode_or_pickle(value, f"argument {name!r} of {trainer_class.__name__}", params, pickles, name)
    if reference(trainer_class) is None:
        pickles[CLASS_ENTRY] = cloudpickle.dumps(trainer_class)
    ident = identity(trainer_class, init_args)
    fields = dict(
        trainer_class=qualified_name(trainer_class),
        trainer_mro=[qualified_name(c) for c in trainer_class.__mro__ if c is not object],
        params=params, pickled_params=sorted(k for k in pickles if k != CLASS_ENTRY),
        must_respecify=must_respecify, dataset_names=sorted(init_args.get(DATASETS) or {}),
        identity=ident, identity_fingerprint=fingerprint(ident),
        code_fingerprints=code_fingerprints(init_args))
    params_json = json.dumps(describe(init_args.get("train_loop_config")), indent=2, sort_keys=True)
    return SavedTrainer(fields, pickles, params_json.encode())


def write_trainer(storage: Storage, manifest: RunManifest, saved: SavedTrainer) -> None:
    """Write the pickled arguments (one file each) and params.json and fill the manifest
    (saved by the caller). `manifest` is still the one on storage, or a new one."""
    replace_pickles(storage, manifest.schema_version, PICKLED_DIR, saved.pickles, manifest.pickled_params,
                    LEGACY_TRAINER_PKL)
    for key, value in saved.fields.items():
        setattr(manifest, key, value)
    manifest.schema_version, manifest.package_version = SCHEMA_VERSION, __version__
    storage.write_atomic(PARAMS_JSON, saved.params_json)


def pickles_needed(pickles: SavedPickles, manifest: RunManifest, requested: type,
                   overrides: dict[str, Any]) -> tuple[list[str], bool]:
    """(the saved arguments restore would unpickle, whether it would unpickle the trainer
    class too); reads only the manifest and, for the class, tries importing it."""
    needed = [n for n in manifest.pickled_params if n not in overrides]
    requested_name = qualified_name(requested)
    cls_needed = False
    if requested_name != manifest.trainer_class and requested_name in manifest.trainer_mro:
        try:
            import_by_name(manifest.trainer_class)
        except (ImportError, AttributeError):
            cls_needed = pickles.has(CLASS_ENTRY) is not False
    return needed, cls_needed


def check_trainer_pickles(pickles: SavedPickles, manifest: RunManifest, requested: type,
                          overrides: dict[str, Any], path: str) -> None:
    """For restore(allow_pickle=False): PickleRefusedError, before anything is unpickled, if
    rebuilding the trainer would unpickle anything."""
    requested_name = qualified_name(requested)
    if requested_name != manifest.trainer_class and requested_name not in manifest.trainer_mro:
        return  # resolve_class names the saved class
    needed, cls_needed = pickles_needed(pickles, manifest, requested, overrides)
    saved_cls = manifest.trainer_class.split(":")[-1]
    what = [f"the argument{'s' if len(needed) > 1 else ''} {', '.join(map(repr, needed))}"] if needed else []
    notes = ""
    if cls_needed:
        module = manifest.trainer_class.split(":")[0]
        what.append(f"the trainer class {manifest.trainer_class} (it cannot be imported here)")
        notes = (f"for the class, call restore on the class itself, {saved_cls}.restore(...)"
                 + (", in a script that defines it" if module == "__main__" else
                    f", or make the module {module!r} importable (PYTHONPATH)"))
    refuse_pickles(what, path, f"{requested.__name__}.restore({path!r}, allow_pickle=False)", needed, notes)


# -- loading ------------------------------------------------------------------------------
def resolve_class(pickles: SavedPickles, manifest: RunManifest, requested: type, path: str) -> type:
    """The class to rebuild: `requested` itself, or the saved subclass of it."""
    requested_name = qualified_name(requested)
    if requested_name == manifest.trainer_class:
        return requested
    if requested_name not in manifest.trainer_mro:
        saved = manifest.trainer_class.split(":")[-1]
        raise TrainerClassMismatchError(
            f"the run at {path!r} was saved by {manifest.trainer_class}, which is not a "
            f"{requested.__name__}. Hint: use {saved}.restore({path!r}), or BaseTrainer.restore "
            "to get whatever class was saved")
    return _load_saved_class(pickles, manifest, path)


def _load_saved_class(pickles: SavedPickles, manifest: RunManifest, path: str) -> type:
    try:
        return import_by_name(manifest.trainer_class)
    except (ImportError, AttributeError):
        pass
    try:
        return pickles.load(CLASS_ENTRY)
    except FileNotFoundError:
        raise RestoreArgumentError(f"the trainer class {manifest.trainer_class} saved in {path!r} cannot be "
                                   "imported. Hint: make its module importable (PYTHONPATH), or call "
                                   "restore on the class itself") from None


def load_init_args(pickles: SavedPickles, manifest: RunManifest, cls: type, overrides: dict[str, Any],
                   path: str) -> dict[str, Any]:
    """The saved arguments, with `overrides` taking the place of (never loading) saved ones."""
    valid = sorted(set(manifest.params) | set(manifest.pickled_params) | set(manifest.must_respecify)
                   | set(init_param_names(cls)))
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise UnknownOverrideError(f"{cls.__name__}.restore() got unknown argument(s) {', '.join(unknown)}; "
                        f"Hint: the arguments that can be re-specified are: {', '.join(valid)}")
    args: dict[str, Any] = {}
    for name, value in manifest.params.items():
        if name not in overrides:
            args[name] = decode(value)
    for name in manifest.pickled_params:
        if name in overrides:
            continue
        args[name] = load_pickled(pickles, name, f"argument {name!r} saved with the run at {path!r}",
                                  f"{cls.__name__}.restore({path!r}, {name}=...)")
    for name in manifest.must_respecify:
        if name not in overrides:
            keys = ", ".join(f"{k!r}: ..." for k in manifest.dataset_names) if name == DATASETS else ""
            example = f"{{{keys}}}" if name == DATASETS else "..."
            raise RestoreArgumentError(
                f"argument {name!r} was not saved with the run at {path!r} and must be re-specified. "
                f"Hint: {cls.__name__}.restore({path!r}, {name}={example})")
    if DATASETS in overrides and manifest.dataset_names:
        given = sorted(overrides[DATASETS] or {})
        if given != manifest.dataset_names:
            raise RestoreArgumentError(f"datasets must be re-specified with the same keys as the saved run: "
                             f"saved {manifest.dataset_names}, given {given}. Hint: "
                             f"{cls.__name__}.restore({path!r}, datasets={{...}}) with keys "
                             f"{manifest.dataset_names}")
    args.update(overrides)
    return args


def load_saved_arg(storage: Storage, manifest: RunManifest, name: str) -> Any:
    """One saved constructor argument, decoded or unpickled on its own (None if it was not
    saved), e.g. the run_config that `unbroken resume --max-failures` amends."""
    if name in manifest.params:
        return decode(manifest.params[name])
    if name in manifest.pickled_params:
        return SavedPickles.of_run(storage, manifest).load(name)
    return None


def load_pickled(pickles: SavedPickles, name: str, what: str, respecify: str) -> Any:
    """One pickled argument (of a run or a sweep); one that no longer loads is named (`what`)
    in a RestoreArgumentError that shows the call re-specifying it (`respecify`)."""
    try:
        return pickles.load(name)
    except PickleRefusedError:
        raise
    except Exception as e:
        raise RestoreArgumentError(f"{what} can no longer be loaded ({type(e).__name__}: {e}). Hint: "
                                   f"re-specify it: {respecify}") from None
