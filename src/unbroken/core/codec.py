"""The argument codec: how a constructor argument becomes something storable and back.

Plain data (None, bool, int, float, str, lists, tuples, string-keyed dicts, dataclasses of
plain data) becomes JSON; functions and classes importable by module path become references
(`{"__ref__": "module:qualname"}`); everything else is cloudpickled, one argument at a time
(`encode_or_pickle`). `describe` gives a JSON view of any value for identities and display.

Stored references name unbroken's own classes by the module paths the storage format was
fixed with (`unbroken.config:RunConfig`, `unbroken.trainer:DataParallelTrainer`), whatever
module holds them now, so that run.json, its identity fingerprint and the pickles of runs
written before a module moved keep loading (`core.stable_names`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import json
from typing import Any

import cloudpickle

from unbroken.core.stable_names import current_module, stable_module
from unbroken.errors import UnsavableArgumentError


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
    """`module:qualname` of a function or class, with unbroken's own modules by their stable name."""
    return f"{stable_module(obj.__module__)}:{obj.__qualname__}"


def import_by_name(name: str) -> Any:
    """The object a `qualified_name` names (a stable module name leads to where it is now)."""
    module, _, qualname = name.partition(":")
    obj: Any = importlib.import_module(current_module(module))
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def reference(obj: Any) -> str | None:
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
        ref = reference(type(value))
        if ref is None:
            raise _NotJSON
        return {"__dataclass__": ref, "fields": {f.name: encode(getattr(value, f.name))
                                                 for f in dataclasses.fields(value) if f.init}}
    if callable(value):
        ref = reference(value)
        if ref is not None:
            return {"__ref__": ref}
    raise _NotJSON


def decode(value: Any) -> Any:
    """The value `encode` stored (references imported, dataclasses rebuilt)."""
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
            # A field added after the value was stored takes the default that applied then,
            # where that differs from today's (a run keeps the behaviour it started with).
            return cls(**{**getattr(cls, "STORED_BEFORE", {}), **fields})
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
    return {"__object__": f"{stable_module(kind.__module__)}.{kind.__qualname__}"}


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
    """The names a constructor takes by position or keyword (what restore() may re-specify)."""
    return [p.name for p in list(inspect.signature(cls.__init__).parameters.values())[1:]
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def fingerprint(obj: Any) -> str:
    """A short stable hash of a JSON-able value (identities, function sources)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def is_function(value: Any) -> bool:
    """A function or method (saved by reference or pickled; its source is fingerprinted)."""
    return inspect.isfunction(value) or inspect.ismethod(value) or inspect.isbuiltin(value)


def is_dataset_builder(obj: Any) -> bool:
    """A zero-argument function or class that builds a dataset (saved with the run, and called
    in each worker) rather than a dataset itself (never saved)."""
    return inspect.isfunction(obj) or isinstance(obj, type)
