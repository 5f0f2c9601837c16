"""Sharded model and optimizer state through torch.distributed.checkpoint (DCP).

Under FSDP2 (`fully_shard`) or tensor parallelism the parameters are DTensors: each rank
holds a shard, and rank 0's `state_dict()` is not the model. For such a model TrainState
saves the model and optimizer here instead of in `train_state.pt`: every rank writes its own
shards (`__<rank>_0.distcp`) and rank 0 DCP's index (`.metadata`) into one directory of the
checkpoint. Loading goes through DCP's planner, which reads whatever slices this rank's
layout needs, so a checkpoint saved by N ranks loads onto M ranks, or into one plain process.

DCP stores its index with pickle and non-tensor values (the optimizer's param_groups) with
torch.save. Both are read here with restricted loaders (`weights_only=True`; an allow-list of
DCP's own metadata classes), as everything else unbroken loads.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from unbroken.errors import StateMismatchError

logger = logging.getLogger("unbroken")

#: DCP's index file, written by rank 0.
DCP_METADATA = ".metadata"


def shard_dir(attempt: int | None) -> str:
    """The checkpoint subdirectory that holds the DCP files. Inside a run it names the attempt,
    so that on object stores (where files are written under their final names) a writer left
    over from a dead attempt cannot overwrite the files of the attempt that commits."""
    return f"dcp-a{attempt}" if attempt else "dcp"


def save(directory: str, state: dict[str, Any], process_group: Any = None) -> list[str]:
    """Write this rank's shards of `state` (`live_state`, or a snapshot of it) into `directory`,
    and DCP's `.metadata` on rank 0; returns the names of the files this rank wrote.
    Collective: every rank of `process_group` (default: the default group) calls it, with the
    same `directory` name or one of its own.

    The files are not fsynced here: the report that stages them makes them durable (it
    flushes each file while summing it for the commit marker, and fsyncs the directories)."""
    metadata = dcp.save(state, storage_writer=FileSystemWriter(directory, sync_files=False),
                        process_group=process_group)
    # The index lists every rank's files (dcp.save returns the global metadata on every rank);
    # rank r's data files are named __<r>_<n>.distcp, and rank 0 (the coordinator) wrote the index.
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    mine = {info.relative_path for info in (metadata.storage_data or {}).values()
            if info.relative_path.startswith(f"__{rank}_")}
    return sorted(mine | ({DCP_METADATA} if rank == 0 else set()))


_background: dict[int, Any] = {}


def background_group() -> Any:
    """A gloo group of every rank for saves written in the background: DCP's collectives there
    must not interleave with training's on the default group. Created once per default group,
    collectively (every rank reaches its first asynchronous save at the same report)."""
    world = dist.group.WORLD
    if id(world) not in _background:
        _background.clear()  # a default group of an earlier attempt in this process is gone
        _background[id(world)] = dist.new_group(backend="gloo")
    return _background[id(world)]


def load(directory: str, model: Any, optimizer: Any | None) -> None:
    """Load the shards in `directory` into `model` (and `optimizer`), resharding them onto this
    process group's layout (or one plain process). Collective when a process group is up."""
    state = live_state(model, optimizer)
    _reader(directory).read_metadata()  # its errors, before DCP wraps them in its own
    one_process = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():  # DCP warns that one process loads all, which is meant here
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, storage_reader=_reader(directory), planner=_SafeLoadPlanner(), no_dist=one_process)
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def load_saved_by(saved_torch: str | None, directory: str, model: Any, optimizer: Any | None) -> None:
    """`load`, for shards saved with torch `saved_torch`: another version is warned of, and a
    load that then fails says so (DCP promises no compatibility across versions)."""
    other_torch = saved_torch != torch.__version__
    if other_torch:
        logger.warning("%s was saved with torch %s and is loaded with torch %s: "
                       "torch.distributed.checkpoint promises no compatibility across torch "
                       "versions", directory, saved_torch, torch.__version__)
    try:
        load(directory, model, optimizer)
    except StateMismatchError:
        raise
    except Exception as e:
        if not other_torch:
            raise
        raise StateMismatchError(
            f"loading the sharded state in {directory} failed: {type(e).__name__}: {e}. It was saved "
            f"with torch {saved_torch}; this is torch {torch.__version__}, and "
            "torch.distributed.checkpoint promises no compatibility across versions. Hint: restore "
            f"with torch {saved_torch}") from e


def load_full(directory: str) -> dict[str, Any]:
    """The whole state in `directory` as plain tensors, in this process, without a model or a
    process group: {"model": {fqn: tensor}, "optimizer": {"state": {fqn: {...}}, "param_groups":
    [...]}} (the optimizer keyed by parameter names, as get_optimizer_state_dict gives it).
    It needs memory for the whole model."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    # What torch.distributed.checkpoint.format_utils.dcp_to_torch_save does (dcp.load fills
    # only the keys it is given, and here there are none yet).
    state: dict[str, Any] = {}
    _reader(directory).read_metadata()  # its errors, before DCP wraps them in its own
    _load_state_dict(state, storage_reader=_reader(directory), planner=_SafeEmptyLoadPlanner(), no_dist=True)
    return state


def live_state(model: Any, optimizer: Any | None, options: StateDictOptions | None = None) -> dict[str, Any]:
    """{"model": ..., "optimizer": ...} as torch.distributed.checkpoint.state_dict gives them:
    this rank's shards (DTensors) by default, keyed by parameter name (the optimizer too)."""
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=options)}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    return {"model": model_sd, "optimizer": optim_sd}


def full_state_dicts(model: Any, optimizer: Any | None) -> dict[str, Any]:
    """The model's (and optimizer's) whole, unsharded state on every rank, on the CPU: what a
    sharded checkpoint holds, gathered. Collective. For tests and evaluation of small models."""
    return live_state(model, optimizer, StateDictOptions(full_state_dict=True, cpu_offload=True))


# -- restricted loading ------------------------------------------------------------------------

# DCP's index pickles these: its metadata dataclasses, torch sizes, dtypes and layouts, the
# checkpoint's path (a pathlib path) and builtins.
_ALLOWED_MODULES = ("torch.distributed.checkpoint.",)
_ALLOWED_GLOBALS = {("torch", "Size"), ("torch", "dtype"), ("torch", "layout"), ("torch", "memory_format"),
                    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                    ("builtins", "slice"), ("torch._utils", "_rebuild_tensor_v2"),
                    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                    ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata` allowing only DCP's own classes and torch's plain types."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_ALLOWED_MODULES) or (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                        torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"DCP metadata refers to {module}.{name}, which a checkpoint's "
                                     "index never holds; refusing to load it")


class _SafeReader(FileSystemReader):
    """DCP's file reader with its index unpickled by `_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = os.path.join(os.fspath(self.path), DCP_METADATA)
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except FileNotFoundError:
            raise StateMismatchError(f"{os.path.dirname(path)} has no {DCP_METADATA}: the sharded "
                                     "part of this checkpoint is incomplete") from None
        if not isinstance(metadata, Metadata):
            raise StateMismatchError(f"{path} is not DCP metadata (it holds a {type(metadata).__name__})")
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


def _reader(directory: str) -> _SafeReader:
    return _SafeReader(directory)


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, with non-tensor values (the optimizer's param_groups) loaded by
    torch.load(weights_only=True) instead of DCP's unrestricted torch.load."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class _SafeEmptyLoadPlanner(_SafeLoadPlanner, _EmptyStateDictLoadPlanner):
    """DCP's planner that rebuilds the whole state from the index, loading as `_SafeLoadPlanner`."""


def save_into(directory: str, shards: str, state: dict[str, Any], shards_in: str | None = None,
             group: Any = None) -> list[str]:
    """Write a sharded state through torch.distributed.checkpoint (collective over `group`)
    into `directory/shards`, or into `shards_in/shards` with links to them in `directory`
    (see `TrainState._write`); returns the file names relative to `directory`."""
    local = os.path.join(directory, shards)
    target = os.path.join(shards_in, shards) if shards_in is not None else local
    names = save(target, state, group)
    if target != local:
        os.makedirs(local)
        for name in names:
            os.symlink(os.path.join(target, name), os.path.join(local, name))
    return [f"{shards}/{name}" for name in names]
