"""The restore rules: how a trainer's constructor arguments are saved, what a run's
identity is, and how a trainer is rebuilt from a run directory.

Arguments that are plain data go into run.json as JSON. Functions importable by module
path are saved by reference. Everything else is cloudpickled *one argument at a time*,
each into its own file under `.unbroken/pickled/`, so an argument that no longer loads is
named, re-specifying it means the stored copy is never read, and nothing is unpickled
that restore() does not need (`allow_pickle=False`: nothing at all). Datasets are never
pickled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import cloudpickle

from unbroken import __version__
from unbroken.errors import (
    IdentityMismatchError,
    PickleRefusedError,
    RestoreArgumentError,
    TrainerClassMismatchError,
    UnknownOverrideError,
    UnsavableArgumentError,
)
from unbroken.execution.engine.factory import check_can_run
from unbroken.store import opening
from unbroken.store.commit import remove_leftovers
from unbroken.store.manifest import FINISHED, SCHEMA_VERSION, RunManifest, config_change_lines
from unbroken.store.manifest import is_run_dir as manifest_exists
from unbroken.store.manifest import load as load_manifest
from unbroken.store.pickled import (
    LEGACY_TRAINER_PKL,
    PICKLED_DIR,
    SavedPickles,
    pickled_files,
    refuse_pickles,
    write_pickles,
)
from unbroken.store.storage import Storage
from unbroken.worker.session import is_dataset_builder

log = logging.getLogger("unbroken")

PARAMS_JSON = "params.json"
DATASETS = "datasets"
# Arguments that may change between attempts; every other plain argument is the run's identity.
MUTABLE = frozenset({"scaling_config", "run_config", "backend_config", "resume_from_checkpoint",
                     "torch_config"})
CLASS_ENTRY = "__trainer_class__"


def encode_or_pickle(value: Any, what: str, json_out: dict[str, Any], pickles: dict[str, bytes],
                     key: str, pickle_key: str | None = None) -> None:
    """Save one argument: JSON into json_out[key] where it is plain data, else its cloudpickle
    into pickles[pickle_key or key]; UnsavableArgumentError naming `what` if neither works."""
    try:
        json_out[key] = encode(value)
    except _NotJSON:
        try:
            pickles[pickle_key or key] = cloudpickle.dumps(value)
        except Exception as e:
            raise UnsavableArgumentError(
                f"{what} cannot be saved for restore ({type(e).__name__}: {e}). Every argument is "
                f"saved so that the run can be restored. Hint: pass something picklable, or build the "
                f"object inside the training function from plain settings in train_loop_config") from None


class _NotJSON(Exception):
    pass


# -- references ---------------------------------------------------------------------------
def qualified_name(obj: Any) -> str:
    return f"{obj.__module__}:{obj.__qualname__}"


def import_by_name(name: str) -> Any:
    module, _, qualname = name.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _reference(obj: Any) -> str | None:
    """module:qualname if `obj` is a function or class that importing by name gives back."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname:
        return None
    try:
        return qualified_name(obj) if import_by_name(f"{module}:{qualname}") is obj else None
    except (ImportError, AttributeError):
        return None


# -- JSON encoding of plain data ---------------------------------------------------------
def encode(value: Any) -> Any:
    """JSON for plain data, dataclasses of plain data and importable functions; else _NotJSON."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [encode(v) for v in value]
        return items if isinstance(value, list) else {"__tuple__": items}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise _NotJSON
        return {k: encode(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        ref = _reference(type(value))
        if ref is None:
            raise _NotJSON
        return {"__dataclass__": ref, "fields": {f.name: encode(getattr(value, f.name))
                                                 for f in dataclasses.fields(value) if f.init}}
    if callable(value):
        ref = _reference(value)
        if ref is not None:
            return {"__ref__": ref}
    raise _NotJSON


def decode(value: Any) -> Any:
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(decode(v) for v in value["__tuple__"])
        if "__ref__" in value:
            return import_by_name(value["__ref__"])
        if "__dataclass__" in value:
            cls = import_by_name(value["__dataclass__"])
            if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
                # run.json names what to call; only a dataclass's constructor is ever called.
                raise TypeError(f"{value['__dataclass__']} is not a dataclass")
            fields = {k: decode(v) for k, v in value["fields"].items()}
            return cls(**fields)
        return {k: decode(v) for k, v in value.items()}
    return value


def describe(value: Any) -> Any:
    """A JSON view of a value for identity and display: objects become their type name."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): describe(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: describe(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    kind = type(value)
    return {"__object__": f"{kind.__module__}.{kind.__qualname__}"}


# -- constructor arguments ----------------------------------------------------------------
def bind_init_args(cls: type, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The constructor's arguments by name, defaults included (what restore() can re-specify)."""
    sig = inspect.signature(cls.__init__)
    bound = sig.bind(None, *args, **kwargs)
    bound.apply_defaults()
    out: dict[str, Any] = {}
    params = list(sig.parameters.values())[1:]
    for p in params:
        value = bound.arguments.get(p.name)
        if p.kind is p.VAR_POSITIONAL:
            if value:
                raise UnsavableArgumentError(
                    f"{cls.__name__}: *{p.name} arguments cannot be saved for restore; pass them by keyword")
        elif p.kind is p.VAR_KEYWORD:
            out.update(value or {})
        else:
            out[p.name] = value
    return out


def init_param_names(cls: type) -> list[str]:
    return [p.name for p in list(inspect.signature(cls.__init__).parameters.values())[1:]
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _is_function(value: Any) -> bool:
    return inspect.isfunction(value) or inspect.ismethod(value) or inspect.isbuiltin(value)


def identity(trainer_class: type, init_args: dict[str, Any]) -> dict[str, Any]:
    """What makes a run this run: its class, its plain non-mutable arguments, its dataset names."""
    ident: dict[str, Any] = {"trainer_class": qualified_name(trainer_class)}
    for name, value in sorted(init_args.items()):
        if name in MUTABLE or _is_function(value):
            continue
        if name == DATASETS:
            ident[DATASETS] = sorted(value or {})
        else:
            ident[name] = describe(value)
    return ident


def fingerprint(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def code_fingerprints(init_args: dict[str, Any]) -> dict[str, str]:
    out = {}
    for name, value in init_args.items():
        if _is_function(value):
            try:
                out[name] = fingerprint(inspect.getsource(value))
            except (OSError, TypeError):
                out[name] = fingerprint(getattr(getattr(value, "__code__", None), "co_code", b"").hex())
    return out


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict) and obj and "__object__" not in obj:
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else k))
        return out
    return {prefix: obj}


def identity_changes(saved: dict[str, Any], now: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """What differs between two identities, by key path: {key: {"saved": a, "now": b}}, a
    side left out where the key is absent (the form `Attempt.config_change` records)."""
    a, b = _flatten(saved), _flatten(now)
    changes: dict[str, dict[str, Any]] = {}
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b or a[key] != b[key]:
            changes[key] = {side: ident[key] for side, ident in (("saved", a), ("now", b)) if key in ident}
    return changes


def identity_diff(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    return config_change_lines(identity_changes(saved, now))


def check_identity(manifest: RunManifest, trainer_class: type, init_args: dict, path: str,
                   allow_change: bool = False) -> None:
    """Auto-resume guard: raise IdentityMismatchError with the diff and the ways out, unless
    `allow_change` (RunConfig.allow_config_change) accepts it; a different trainer class is
    never accepted."""
    now = identity(trainer_class, init_args)
    lines = identity_diff(manifest.identity, now)
    if not lines:
        return
    diff = "\n".join(lines)
    cls = trainer_class.__name__
    if manifest.identity.get("trainer_class") not in (None, now["trainer_class"]):
        raise IdentityMismatchError(
            f"the run at {path!r} was started by another trainer class:\n{diff}\nHint: run it with "
            f"{manifest.trainer_class.split(':')[-1]}, or give RunConfig a new name for a separate run.")
    if allow_change:
        return
    raise IdentityMismatchError(
        f"the run at {path!r} was started with a different configuration:\n{diff}\n"
        f"Hint: to continue this run with the new configuration (e.g. more epochs), pass "
        f"RunConfig(..., allow_config_change=True); the change is recorded with the attempt. "
        f"To start a separate run, give RunConfig a new name. (Or amend it explicitly: "
        f"{cls}.restore({path!r}, <changed argument>=...).fit().)")


# -- saving -------------------------------------------------------------------------------
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
        if name == DATASETS and value:
            builders = {k: ds for k, ds in value.items() if is_dataset_builder(ds)}
            if len(builders) != len(value):
                must_respecify.append(name)
                continue
            value = builders
        encode_or_pickle(value, f"argument {name!r} of {trainer_class.__name__}", params, pickles, name)
    if _reference(trainer_class) is None:
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
    keep = manifest.pickled_params if pickled_files(manifest.schema_version) else ()
    write_pickles(storage, PICKLED_DIR, saved.pickles, keep=keep)
    if pickled_files(manifest.schema_version) and storage.exists(LEGACY_TRAINER_PKL):
        storage.remove(LEGACY_TRAINER_PKL)  # left by a schema 1 run that has been rewritten since
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
        try:
            args[name] = pickles.load(name)
        except PickleRefusedError:
            raise
        except Exception as e:
            raise RestoreArgumentError(
                f"argument {name!r} saved with the run at {path!r} can no longer be loaded "
                f"({type(e).__name__}: {e}). Hint: re-specify it: "
                f"{cls.__name__}.restore({path!r}, {name}=...)") from None
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


# -- fit(): create, auto-resume or continue a run -------------------------------------------
def default_name(trainer_class: type) -> str:
    return f"{trainer_class.__name__}_{time.strftime('%Y-%m-%d_%H-%M-%S')}"


def restore_hint(trainer_class: type, path: str) -> str:
    return (f"{trainer_class.__name__}.restore({path!r}).fit(), or by running the same script "
            "again with the same RunConfig(name=..., storage_path=...)")


# What is particular to runs in opening one (see unbroken.store.opening). Leftovers: what a torn
# checkpoint holds is freed before anything else is written.
RUN = opening.Kind(
    noun="run", load=load_manifest, first_files=frozenset({PARAMS_JSON}),
    first_meta=frozenset({"lease.json", "pickled", "trainer.pkl"}),
    free=lambda storage, manifest: remove_leftovers(storage, manifest.attempt_count))


def _new_manifest(name: str) -> RunManifest:
    return RunManifest(name=name, trainer_class="", trainer_mro=[])  # write_trainer fills it


def open_run(trainer: Any) -> tuple[Any, Any]:
    """Apply the restore rules for a fit() call. Returns (Run to drive, None) or (None, Result)
    for a finished run. Raises before writing anything when the run must not start."""
    from unbroken.run.handle import Run
    from unbroken.run.result import Result

    cls = type(trainer)
    config = trainer.run_config
    restored = trainer._restored_from is not None
    if restored:
        storage = Storage.from_url(trainer._restored_from, config.storage_filesystem)
    else:
        root = Storage.from_url(config.resolved_storage_path(), config.storage_filesystem)
        storage = root.child(config.name)
    path = storage.url()
    check_can_run(trainer.scaling_config)  # fails now for an engine or GPUs this machine lacks
    saved = encode_trainer(cls, trainer._init_args)  # fails now if an argument cannot be saved

    manifest = opening.existing(
        RUN, storage, exists=restored or manifest_exists(storage), restored=restored, resume=config.resume,
        check_identity=lambda m: check_identity(m, cls, trainer._init_args, path, config.allow_config_change))
    changed = manifest is not None and bool(identity_changes(manifest.identity, saved.fields["identity"]))
    if manifest is not None and manifest.status == FINISHED and not (trainer._restore_overrides or changed):
        log.info("run %s already finished; returning its stored result", path)
        return None, Result.from_path(path, config.storage_filesystem)

    with opening.leased(RUN, storage, manifest, _new_manifest) as (lease, manifest, previous):
        change = _amendments(manifest, saved, path) if previous is not None else {}
        write_trainer(storage, manifest, saved)
        run = Run(storage, manifest, previous, lease, config.checkpoint_config)
        run.config_change = change or None
        return run, None


def _amendments(manifest: RunManifest, saved: SavedTrainer, path: str) -> dict[str, dict[str, Any]]:
    """Log how this fit() changes the run's identity and code; returns the identity change."""
    change = identity_changes(manifest.identity, saved.fields["identity"])
    if change:
        log.warning("run %s continues with a changed configuration:\n%s", path,
                    "\n".join(config_change_lines(change)))
    for name, fp in saved.fields["code_fingerprints"].items():
        if manifest.code_fingerprints.get(name) not in (None, fp):
            log.info("run %s: %s changed since the run was saved; using the new code", path, name)
    return change
