"""Loading into a TrainState: a checkpoint directory its `save` wrote (`load`), or the same
contents as a surviving rank sent them when the run recovers in place (`apply`), go into its
live objects, its plain values and this rank's generators.

The functions take the TrainState's tables (objects, plain values, generators, by name) and
load into them in place.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from unbroken.errors import StateMismatchError
from unbroken.state.state_file import (
    STATE_FILE,
    compare_names,
    loader_file,
    read_payload,
    restore_rng,
    rng_file,
    unwrap,
)
from unbroken.state.stream_loader import StreamLoader, seek_from
from unbroken.worker import sharded_objects
from unbroken.worker.torch_backend import worker_ranks

logger = logging.getLogger("unbroken")


def load(objects: dict[str, Any], values: dict[str, Any], generators: dict[str, torch.Generator],
         directory: str, strict: bool) -> None:
    """Load the checkpoint `directory` (`TrainState.load`): `train_state.pt`, this rank's
    stream loader positions, and last its generators."""
    path = os.path.join(directory, STATE_FILE)
    if not os.path.exists(path):
        raise StateMismatchError(
            f"{directory} has no {STATE_FILE}, so it was not written by TrainState (it has: "
            f"{sorted(os.listdir(directory)) if os.path.isdir(directory) else 'no such directory'}). "
            "Hint: a run that saved its own files must keep loading them itself from "
            "train.get_checkpoint(); start a new run to use TrainState")
    payload = read_payload(path)
    apply(objects, values, payload, directory, strict)
    rank, _ = worker_ranks()
    seek_from(os.path.join(directory, loader_file(rank)),
              {name: obj for name, obj in objects.items() if isinstance(obj, StreamLoader)})
    rng_path = os.path.join(directory, rng_file(rank))
    if not os.path.exists(rng_path):
        logger.warning("rank %d has no saved random state in %s (the run had %s workers); its "
                       "generators keep their current state", rank, directory,
                       payload.get("world_size"))
        return
    # Last, so that nothing done while loading draws from the restored generators.
    rng = torch.load(rng_path, weights_only=True, map_location="cpu")
    saved = rng.pop("generators", {})
    compare_names("generator", generators, saved, strict, directory)
    for name, g in generators.items():
        if name in saved:
            g.set_state(saved[name])
    restore_rng(rng)


def apply(objects: dict[str, Any], values: dict[str, Any], payload: dict[str, Any], directory: str,
          strict: bool) -> None:
    """Load `train_state.pt`'s contents (from `directory`, or as a peer sent them) into the
    objects and the plain values."""
    state_dicts: dict[str, Any] = payload["state_dicts"]
    saved_values: dict[str, Any] = payload["values"]
    sharded = payload.get("sharded") or {"names": []}
    compare_names("object", objects, {**state_dicts, **dict.fromkeys(sharded["names"])}, strict,
                  directory)
    compare_names("value", values, saved_values, strict, directory)
    if "model" in state_dicts and sharded_objects.sharded_names(objects):
        raise StateMismatchError(
            f"the checkpoint {directory} holds a whole (unsharded) model, saved from rank 0, "
            "and this run's model is sharded (DTensor parameters); TrainState loads sharded "
            "state only from a sharded checkpoint. Hint: resume with the model as it was saved "
            "(DDP or plain), or start a new run from these weights: load them into the model "
            "before sharding it")
    if "model" in sharded["names"] and "model" in objects:
        sharded_objects.load_shards(objects, os.path.join(directory, sharded["directory"]), sharded["names"],
                                    payload.get("torch_version"))
    for name, obj in objects.items():
        if name in state_dicts:
            (unwrap(obj) if name == "model" else obj).load_state_dict(state_dicts[name])
    for name in values:
        if name in saved_values:
            values[name] = saved_values[name]
