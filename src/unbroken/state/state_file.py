"""The TrainState checkpoint format: what `train_state.pt` and the per-rank RNG files hold,
how they are written and read, and how this process's random generators are captured and set.

One home for the format, so that a report's checkpoint (`worker.train_state`), a just-in-time
checkpoint (`worker.recovery.just_in_time`) and reading a checkpoint whole (`Checkpoint.to_state_dict`) agree:

- `train_state.pt` (rank 0): `{"format", "world_size", "torch_version", "state_dicts",
  "values"}` and, for a sharded model, `"sharded": {"directory", "names"}` (format 2).
- `rng_rank<r>.pt` (every rank): python, numpy, torch CPU and current CUDA device generator
  states, and the TrainState's torch.Generator extras under `"generators"`.
- `loader_rank<r>.pt` (every rank with a stream loader, `state.stream_loader`): that rank's
  library state of each, by name, with the position it belongs to.

Both load with `torch.load(..., weights_only=True)`. This module knows nothing of runs or
sessions: ranks, directories and generators are passed in.
"""

from __future__ import annotations

import logging
import os
import random
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from unbroken.errors import StateMismatchError

try:
    import numpy as _np
except ImportError:  # pragma: no cover - numpy is optional
    _np = None

logger = logging.getLogger("unbroken")

FORMAT_VERSION = 1
# train_state.pt of a checkpoint whose model and optimizer were saved sharded (an older
# unbroken refuses it instead of loading a state without its model).
SHARDED_FORMAT_VERSION = 2
STATE_FILE = "train_state.pt"

PLAIN_SCALARS = (type(None), bool, int, float, complex, str, bytes)
# What torch.load(weights_only=True) accepts, checked at save time so that a checkpoint
# that could not be loaded is refused when it is written, not when it is needed.
LOADABLE_SCALARS = PLAIN_SCALARS + (torch.Size, torch.dtype, torch.device)


def rng_file(rank: int) -> str:
    """The name of rank `rank`'s RNG file in a TrainState checkpoint."""
    return f"rng_rank{rank}.pt"


def loader_file(rank: int) -> str:
    """The name of rank `rank`'s file of stream loader states (`StreamLoader.seek_state`)."""
    return f"loader_rank{rank}.pt"


def unwrap(model: Any) -> Any:
    """The module whose state_dict has the plain parameter names (no DDP or compile prefix)."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model, torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def plain_problem(value: Any, where: str, scalars: tuple[type, ...] = PLAIN_SCALARS) -> str | None:
    """None if `value` loads back as itself with torch.load(weights_only=True); else what is wrong."""
    if type(value) in scalars:
        return None
    if isinstance(value, torch.Tensor):
        if type(value).__name__ == "DTensor":
            return (f"{where} is a DTensor (one shard of a sharded tensor; saved from rank 0 it would "
                    "hold rank 0's shard only)")
        return None
    if type(value) in (list, tuple, set):
        for i, item in enumerate(value):
            problem = plain_problem(item, f"{where}[{i}]", scalars)
            if problem:
                return problem
        return None
    if type(value) in (dict, OrderedDict):
        for key, item in value.items():
            if type(key) not in scalars:
                return f"{where} has a key of type {type(key).__name__}"
            problem = plain_problem(item, f"{where}[{key!r}]", scalars)
            if problem:
                return problem
        return None
    return f"{where} is a {type(value).__module__}.{type(value).__qualname__}"


def compare_names(kind: str, declared: Mapping[str, Any], saved: Mapping[str, Any], strict: bool,
                  directory: str) -> None:
    """Check that a checkpoint holds the same `kind`s (objects, values, generators) by name as
    the TrainState loading it: with `strict`, a difference raises StateMismatchError listing
    both sides; without, it is logged and the rest loads."""
    missing = sorted(set(declared) - set(saved))
    unknown = sorted(set(saved) - set(declared))
    if not (missing or unknown):
        return
    message = (f"the checkpoint {directory} does not hold the same {kind}s as this TrainState: "
               + "; ".join(part for part in (
                   f"not in the checkpoint: {missing}" if missing else "",
                   f"not in this TrainState: {unknown}" if unknown else "") if part))
    if strict:
        raise StateMismatchError(message + ". Hint: build the TrainState with the same names the "
                                 "run saved, or call restore(strict=False) to load what matches")
    logger.warning("%s; loading the rest (strict=False)", message)


def build_payload(state_dicts: dict[str, Any], values: dict[str, Any], world_size: int,
                  sharded: dict[str, Any] | None = None) -> dict[str, Any]:
    """`train_state.pt`'s contents: the objects' state_dicts and the plain values by name, the
    world size that saved them, and, for a sharded model, where its shards are and what they
    hold (`{"directory": ..., "names": [...]}`). A report and a just-in-time save build it here."""
    payload = {"format": SHARDED_FORMAT_VERSION if sharded else FORMAT_VERSION,
               "world_size": world_size, "torch_version": str(torch.__version__),
               "state_dicts": state_dicts, "values": values}
    if sharded:
        payload["sharded"] = sharded
    return payload


def read_payload(path: str) -> dict[str, Any]:
    """`train_state.pt`, checked to be a format this version reads."""
    payload = torch.load(path, weights_only=True, map_location=map_location())
    found = payload.get("format") if isinstance(payload, dict) else None
    if found not in (FORMAT_VERSION, SHARDED_FORMAT_VERSION):
        raise StateMismatchError(f"{path} has format {found!r}; this version of unbroken reads formats "
                                 f"{FORMAT_VERSION} and {SHARDED_FORMAT_VERSION}. Hint: restore with the "
                                 "unbroken version that wrote it")
    return payload


def load_full_state(directory: str | os.PathLike) -> dict[str, Any]:
    """Everything a TrainState checkpoint directory holds except the random generators, whole,
    in this process, by name: {"model": state_dict, "optimizer": ..., "scheduler": ...,
    "loader": ..., <extra objects' state_dicts>, <plain values>}.

    A sharded model and optimizer are gathered from every rank's shards (this needs memory
    for the whole model, and no process group); their state_dicts are keyed by parameter
    name, as torch.distributed.checkpoint.state_dict gives them."""
    directory = os.fspath(directory)
    path = os.path.join(directory, STATE_FILE)
    if not os.path.exists(path):
        raise StateMismatchError(f"{directory} has no {STATE_FILE}, so it was not written by TrainState")
    payload = read_payload(path)
    out = {**payload["state_dicts"], **payload["values"]}
    sharded = payload.get("sharded")
    if sharded:
        from unbroken.state import sharded as sharded_mod

        out.update(sharded_mod.load_full(os.path.join(directory, sharded["directory"])))
    return out


def write_files(directory: str, rank: int, payload: dict[str, Any] | None,
                rng: dict[str, Any] | None, loaders: dict[str, Any] | None = None) -> list[str]:
    """Write rank `rank`'s files of a checkpoint into `directory`: `train_state.pt` from
    `payload` (rank 0's, from `build_payload`), `rng_rank<rank>.pt` from `rng` (from
    `capture_rng`) and `loader_rank<rank>.pt` from `loaders` (this rank's stream loader
    states, by name), each when given; returns the file names written."""
    written = []
    if payload is not None:
        torch.save(payload, os.path.join(directory, STATE_FILE))
        written.append(STATE_FILE)
    if rng is not None:
        torch.save(rng, os.path.join(directory, rng_file(rank)))
        written.append(rng_file(rank))
    if loaders:
        torch.save(loaders, os.path.join(directory, loader_file(rank)))
        written.append(loader_file(rank))
    return written


def snapshot(value: Any, host: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Any:
    """`value` with every tensor in it copied (plain tensors to CPU memory; a DTensor keeps its
    placement) and its lists, tuples and dicts rebuilt: what training does next changes
    nothing in it.

    A GPU tensor is copied into page-locked (pinned) host memory, all copies queued at once
    and waited for together: a pinned copy runs at the link's full rate and the copies of
    many tensors overlap, where a plain `.cpu()` stages through pageable memory one tensor
    at a time. `host(tensor)` makes the host buffer a device tensor is copied into (default:
    pinned, from torch's caching host allocator, so later saves reuse it)."""
    waits: set[torch.device] = set()
    copied = _snapshot(value, host or _pinned_like, waits)
    for device in waits:
        torch.cuda.current_stream(device).synchronize()
    return copied


def _pinned_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)


def _snapshot(value: Any, host: Callable[[torch.Tensor], torch.Tensor], waits: set[torch.device]) -> Any:
    if isinstance(value, torch.Tensor):
        if type(value).__name__ == "DTensor":
            return value.detach().clone()
        if value.device.type != "cuda":
            return value.detach().to("cpu", copy=True)
        buffer = host(value)
        buffer.copy_(value.detach(), non_blocking=True)
        waits.add(value.device)
        return buffer
    if isinstance(value, dict):
        return type(value)((k, _snapshot(v, host, waits)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(_snapshot(v, host, waits) for v in value)
    return value


def map_location() -> Any:
    """Where saved tensors go: CPU, or this worker's GPU when it uses one (rank 0's file
    names rank 0's device, which is the wrong one on the other ranks)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        here = f"cuda:{torch.cuda.current_device()}"
        return {f"cuda:{i}": here for i in range(torch.cuda.device_count())}
    return "cpu"


def capture_rng(generators: Mapping[str, torch.Generator] | None = None) -> dict[str, Any]:
    """This process's generator states (and those of `generators`, a TrainState's torch.Generator
    extras, by name), in a form torch.load(weights_only=True) loads."""
    version, internal, gauss_next = random.getstate()
    # As a tensor: 625 ints unpickle far faster that way under weights_only=True than as a tuple.
    python = {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
              "gauss_next": gauss_next}
    state: dict[str, Any] = {"python": python, "torch": torch.get_rng_state()}
    if _np is not None:
        _, keys, pos, has_gauss, cached_gaussian = _np.random.get_state()
        state["numpy"] = {"keys": torch.from_numpy(keys.astype(_np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        state["cuda"] = {"device": device, "state": torch.cuda.get_rng_state(device)}
    if generators is not None:
        state["generators"] = {name: g.get_state() for name, g in generators.items()}
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set this process's generators to a state from `capture_rng` (what it lacks is left)."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"].tolist()), py["gauss_next"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state and _np is not None:
        np_state = state["numpy"]
        _np.random.set_state(("MT19937", np_state["keys"].numpy().astype(_np.uint32), np_state["pos"],
                              np_state["has_gauss"], np_state["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"]["state"], torch.cuda.current_device())
