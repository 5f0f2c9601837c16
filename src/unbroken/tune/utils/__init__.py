"""The helpers Ray Tune's examples import from `ray.tune.utils`: dict helpers for configs
(`flatten_dict`, `unflatten_dict`, `merge_dicts`, `deep_update`, `unflattened_lookup`),
`validate_save_restore` for class trainables, and `wait_for_gpu`."""

from __future__ import annotations

import copy
import tempfile
import time
from typing import Any


def flatten_dict(dt: dict[str, Any], delimiter: str = "/", prevent_delimiter: bool = False,
                 flatten_list: bool = False) -> dict[str, Any]:
    """`{"a": {"b": 1}}` as `{"a/b": 1}` (lists too, by index, with `flatten_list`); an empty
    dict stays a value. `prevent_delimiter`: a key that holds the delimiter is a ValueError."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        items: list[tuple[Any, Any]] = []
        if isinstance(node, dict) and node:
            items = list(node.items())
        elif flatten_list and isinstance(node, list) and node:
            items = list(enumerate(node))
        else:
            out[prefix] = node
            return
        for key, value in items:
            key = str(key)
            if prevent_delimiter and delimiter in key:
                raise ValueError(f"found the delimiter {delimiter!r} in the key {key!r}")
            walk(value, f"{prefix}{delimiter}{key}" if prefix else key)

    if not isinstance(dt, dict):
        raise TypeError(f"flatten_dict takes a dict, got {type(dt).__name__}")
    for key, value in dt.items():
        if prevent_delimiter and delimiter in str(key):
            raise ValueError(f"found the delimiter {delimiter!r} in the key {key!r}")
        walk(value, str(key))
    return out


def unflatten_dict(dt: dict[str, Any], delimiter: str = "/") -> dict[str, Any]:
    """`{"a/b": 1}` as `{"a": {"b": 1}}`."""
    out: dict[str, Any] = {}
    for key, value in dt.items():
        node = out
        *parents, last = str(key).split(delimiter)
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"{key!r} goes below {part!r}, which holds a value")
        node[last] = value
    return out


def unflattened_lookup(flat_key: str, lookup: dict[str, Any], delimiter: str = "/", **kwargs: Any) -> Any:
    """`lookup["a"]["b"]` for the key "a/b" (a `default` keyword is returned when missing)."""
    node: Any = lookup
    for part in flat_key.split(delimiter):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif "default" in kwargs:
            return kwargs["default"]
        else:
            raise KeyError(flat_key)
    return node


def deep_update(original: dict[str, Any], new_dict: dict[str, Any], new_keys_allowed: bool = False,
                allow_new_subkey_list: list[str] | None = None,
                override_all_if_type_changes: list[str] | None = None) -> dict[str, Any]:
    """Update `original` in place with `new_dict`, nested dicts key by key. A key `original`
    lacks is a KeyError unless `new_keys_allowed` (at every depth; below a key of
    `allow_new_subkey_list`, new keys are allowed there); below a key of `override_all_if_type_changes`, a
    new "type" replaces the whole dict."""
    allow_new_subkey_list = allow_new_subkey_list or []
    override_all_if_type_changes = override_all_if_type_changes or []
    for key, value in new_dict.items():
        if key not in original and not new_keys_allowed:
            raise KeyError(f"unknown config parameter {key!r}")
        if isinstance(original.get(key), dict) and isinstance(value, dict):
            retyped = "type" in value and value["type"] != original[key].get("type")
            if key in override_all_if_type_changes and retyped:
                original[key] = value
            else:
                deep_update(original[key], value, new_keys_allowed or key in allow_new_subkey_list,
                            allow_new_subkey_list, override_all_if_type_changes)
        else:
            original[key] = value
    return original


def merge_dicts(d1: dict[str, Any], d2: dict[str, Any]) -> dict[str, Any]:
    """A new dict: `d1` deep-updated with `d2` (new keys allowed); neither is changed."""
    return deep_update(copy.deepcopy(d1), d2, new_keys_allowed=True, allow_new_subkey_list=None)


def validate_save_restore(trainable_cls: type, config: dict[str, Any] | None = None,
                          num_gpus: int = 0) -> bool:
    """Check that a `tune.Trainable` subclass resumes from its own checkpoint: a step and a
    save, then a new object that loads it steps as the first one steps on (the same metrics).
    Raises AssertionError saying what did not hold; True otherwise."""
    from unbroken.tune.trainable import Trainable

    if not (isinstance(trainable_cls, type) and issubclass(trainable_cls, Trainable)):
        raise TypeError(f"validate_save_restore takes a tune.Trainable subclass, got {trainable_cls!r}")
    first = trainable_cls(dict(config or {}))
    second = trainable_cls(dict(config or {}))
    try:
        first.step()
        with tempfile.TemporaryDirectory(prefix="unbroken-validate-") as directory:
            state = first.save_checkpoint(directory)
            second.load_checkpoint(state if isinstance(state, dict) else directory)
        went_on, restored = first.step(), second.step()
        name = trainable_cls.__name__
        assert isinstance(restored, dict), f"{name}.step() after a restore returned {restored!r}"
        assert set(restored) == set(went_on), (
            f"{name}.step() after a restore reports {sorted(restored)}, without one {sorted(went_on)}")
    finally:
        first.cleanup()
        second.cleanup()
    return True


def wait_for_gpu(gpu_id: int | str | None = None, target_util: float = 0.01, retry: int = 20,
                 delay_s: float = 5, gpu_memory_limit: float | None = None) -> bool:
    """Wait until this process's GPU (or `gpu_id`) has at most `target_util` of its memory in
    use, checking `retry` times `delay_s` apart (torch's view of the device). RuntimeError when
    there is no GPU, or when it stays busy."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("wait_for_gpu: this process sees no GPU. Hint: give the trial a GPU "
                           "(tune.with_resources(trainable, {'gpu': 1}) or the trainer's ScalingConfig)")
    target = gpu_memory_limit if gpu_memory_limit is not None else target_util
    device = torch.device("cuda", int(gpu_id)) if gpu_id is not None else torch.device("cuda")
    for _ in range(retry):
        free, total = torch.cuda.mem_get_info(device)
        if (total - free) / total <= target:
            return True
        time.sleep(delay_s)  # the GPU is another process's until it frees its memory
    raise RuntimeError(f"wait_for_gpu: {device} stayed above {target:.0%} memory use for "
                       f"{retry * delay_s:g} s")
