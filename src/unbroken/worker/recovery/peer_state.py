"""In-place recovery, the worker's half: when a rank fails, the surviving ranks keep their
processes, and the state of the last complete report goes from one of them to every rank of
the next attempt over its new process group, instead of through storage.

It stands on the just-in-time checkpoint (`worker.recovery.just_in_time`): a rank whose TrainState has
`jit_checkpoint=True` knows, when its loop fails, whether it still holds the state of its
last report k (no optimizer step has begun since), and the per-step random streams give
every rank's random state after report k without that rank. The protocol, in order:

1. Release (every failed rank, once its `Failed` is sent): end its process group and drop
   the references to it (the DDP wrapper the TrainState holds), before the next attempt
   makes a new one in this process. gloo does not promise that this closes the
   connections: a peer already blocked on this rank in a collective stays blocked until
   this process exits (measured with torch 2.13), so the driver replaces a rank that has
   not offered within its bound (`execution.recovery.in_place`).
2. Offer (as for a just-in-time checkpoint): `JitOffer(k)`, then `Failed`.
3. Stay (the driver, see `execution.recovery.in_place`): instead of `JitSave`, each rank that offered
   gets `Stay(source, k)`: rank `source` (the lowest clean one) keeps the state of report k
   in memory (`keep`); every staying rank waits for its next attempt (`Rejoin`). The failed
   ranks, and any that did not offer, are started again in new processes.
4. Share (every rank of the next attempt, right after its process group is up): rank
   `source` broadcasts that state, as `train_state.pt` would hold it, to every rank
   (`share`: its layout, then each tensor); `TrainState.restore` then loads it instead of
   a checkpoint from storage, and seeds the random streams of report k, as after a
   just-in-time resume.

Nothing in storage changes: a driver that dies meanwhile leaves the run to resume from its
latest committed checkpoint, as does any failure before the next attempt's first report.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from unbroken.core import faults
from unbroken.state.state_file import build_payload, unwrap

if TYPE_CHECKING:
    from unbroken.worker.backend import Backend
    from unbroken.worker.session import Session


def release_group(session: Session, backend: Backend, keep_wrappers: bool = False) -> None:
    """Step 1: end this rank's process group and drop the references to it: the armed
    TrainState's DDP wrapper, or, for a loop that goes on (`keep_wrappers`, see
    `worker.recovery.in_loop`), what the wrapper holds of the group."""
    if keep_wrappers:
        for wrapper in session.wrappers:
            for name in ("reducer", "logger", "process_group"):
                wrapper.__dict__.pop(name, None)
    else:
        session.release_wrappers()
        if session.jit is not None and "model" in session.jit.state._objects:
            objects = session.jit.state._objects
            objects["model"] = unwrap(objects["model"])
    try:
        backend.on_shutdown(session)
    except Exception:  # noqa: BLE001 - a broken group may refuse to be destroyed cleanly
        pass
    gc.collect()


def keep(session: Session) -> dict[str, Any]:
    """Step 3 on the source rank: what a checkpoint of its last report would hold."""
    tracker = session.jit
    assert tracker is not None, "only a rank with an armed TrainState is told to stay"
    return build_payload(tracker.state_dicts(), tracker.values, session.info.world_size)


def share(session: Session, kept: dict[str, Any] | None) -> None:
    """Step 4, collective: give every rank the state rank `info.peer_source` kept, as
    `session.peer_state`. Does nothing when the attempt does not recover in place.

    The state's layout (its containers, plain values, and each tensor's shape and dtype)
    goes first, pickled (the peers are ranks of this run); then each tensor is broadcast
    into a tensor the receivers allocate for it: no serialization of the bytes, and the
    sender keeps what it has."""
    info = session.info
    source = info.peer_source
    if source is None:
        return
    if info.world_size == 1 or info.world_rank == source:
        assert kept is not None, "the source rank keeps the state it sends"
    if info.world_size == 1:
        session.hold_peer_state(kept)
        return
    device = _device()
    tensors: list[torch.Tensor] = []
    layout = [(_split(kept, tensors), [(t.shape, t.dtype) for t in tensors]) if info.world_rank == source
              else None]
    dist.broadcast_object_list(layout, source)
    faults.point("during_peer_share")  # crash tests: the sender or a receiver dies mid-transfer
    skeleton, specs = layout[0]
    if info.world_rank != source:
        tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]
    for tensor in tensors:  # received where the group's collectives take them; load_state_dict moves them
        dist.broadcast(tensor.to(device).contiguous() if info.world_rank == source else tensor, source)
    session.hold_peer_state(kept if info.world_rank == source else _join(skeleton, tensors))


@dataclass(frozen=True)
class _Slot:
    """Where tensor `index` of the state goes."""

    index: int


def _split(value: Any, tensors: list[torch.Tensor]) -> Any:
    """`value` with each tensor replaced by a `_Slot`, the tensors appended to `tensors`."""
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        return _Slot(len(tensors) - 1)
    if isinstance(value, dict):
        return type(value)((k, _split(v, tensors)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_split(v, tensors) for v in value)
    return value


def _join(layout: Any, tensors: list[torch.Tensor]) -> Any:
    """The layout with its slots filled from `tensors`."""
    if isinstance(layout, _Slot):
        return tensors[layout.index]
    if isinstance(layout, dict):
        return type(layout)((k, _join(v, tensors)) for k, v in layout.items())
    if isinstance(layout, (list, tuple)):
        return type(layout)(_join(v, tensors) for v in layout)
    return layout


def _device() -> torch.device:
    """Where the process group's collectives take their tensors (NCCL: this rank's GPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
