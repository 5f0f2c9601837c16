"""A TrainState's sharded objects: a model whose parameters are sharded (DTensors: FSDP2,
tensor parallelism) and its optimizer, which go through torch.distributed.checkpoint
(`unbroken.state.sharded`) instead of `train_state.pt`: which objects they are, this rank's
live shards of them, loading them back, and where in the run the shards are written.

`unbroken.state.sharded` imports torch.distributed.checkpoint, a second to import, so it is
imported here only once a model is sharded.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from unbroken.state.state_file import unwrap
from unbroken.store.commit import staging_name
from unbroken.worker import session as session_mod


def is_sharded(model: Any) -> bool:
    """True when `model` holds sharded parameters (DTensor: FSDP2, tensor parallelism).

    Without importing torch.distributed.tensor (a second to import): no DTensor exists
    until something imported it."""
    tensor_mod = sys.modules.get("torch.distributed.tensor")
    if tensor_mod is None or not isinstance(model, torch.nn.Module):
        return False
    return any(isinstance(p, tensor_mod.DTensor) for p in model.parameters())


def sharded_names(objects: dict[str, Any]) -> list[str]:
    """Which of `objects` (a TrainState's, by name) are saved one shard per rank: the model
    when its parameters are sharded, and its optimizer once it holds state (before its first
    step there are no shards, only settings)."""
    model = objects.get("model")
    if model is None or not is_sharded(unwrap(model)):
        return []
    optimizer = objects.get("optimizer")
    stepped = optimizer is not None and bool(getattr(optimizer, "state", None))
    return ["model", "optimizer"] if stepped else ["model"]


def live_shards(objects: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """This rank's shards of the model (and of the optimizer, when `names` has it), for
    torch.distributed.checkpoint."""
    from unbroken.state import sharded as sharded_mod

    optimizer = objects["optimizer"] if "optimizer" in names else None
    return sharded_mod.live_state(unwrap(objects["model"]), optimizer)


def load_shards(objects: dict[str, Any], directory: str, names: list[str], saved_torch: str | None) -> None:
    """Load the model (and the optimizer, when `names` has it) saved through
    torch.distributed.checkpoint into `directory`, resharded onto this run's layout. Collective."""
    from unbroken.state import sharded as sharded_mod

    optimizer = objects.get("optimizer") if "optimizer" in names else None
    sharded_mod.load_saved_by(saved_torch, directory, unwrap(objects["model"]), optimizer)


def shard_dir() -> str:
    """The directory of a checkpoint that this attempt's shards go into (outside a run too)."""
    from unbroken.state import sharded as sharded_mod

    session = session_mod.active()
    return sharded_mod.shard_dir(session.info.attempt if session is not None else None)


def next_staging() -> str | None:
    """Where the next report's checkpoint is staged, when that is a local directory: sharded
    files are written there directly, so that their bytes are written once (the report finds
    them in place and only sums them). None on object stores, where the report uploads them."""
    session = session_mod.current("TrainState.report()")
    storage = session.info.storage
    if not storage.renames_atomically:
        return None
    return storage.local_path(staging_name(session.iteration + 1, session.info.attempt, storage))
