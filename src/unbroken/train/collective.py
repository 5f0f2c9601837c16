"""Collective operations across the ranks of a run, as Ray Train V2's `ray.train.collective`.

Both run over the torch.distributed process group the trainer's backend set up
(`TorchTrainer`, or a `DataParallelTrainer` with `backend_config=TorchConfig()`). Every
rank must call them, in the same order, like any collective. With one worker they return
at once, and outside a training function they raise with a hint.
"""

from __future__ import annotations

import pickle
from typing import Any, TypeVar

from unbroken.worker import session as _session

__all__ = ["barrier", "broadcast_from_rank_zero"]

T = TypeVar("T")


def barrier() -> None:
    """Wait until every rank has called `barrier()`."""
    dist = _process_group("barrier()")
    if dist is not None:
        dist.barrier()


def broadcast_from_rank_zero(data: T) -> T:
    """Rank 0's `data` on every rank (what other ranks pass is ignored). Also a barrier.

    `data` must pickle; if rank 0's does not, every rank raises the same TypeError instead
    of waiting forever for it.
    """
    dist = _process_group("broadcast_from_rank_zero()")
    if dist is None:
        return data
    message: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            pickle.dumps(data)
            message = [(True, data)]
        except Exception as e:  # pickle raises many kinds: report them all the same way
            message = [(False, f"{type(e).__name__}: {e}")]
    dist.broadcast_object_list(message, src=0)
    ok, value = message[0]
    if not ok:
        raise TypeError(f"broadcast_from_rank_zero: rank 0's data cannot be pickled ({value}). "
                        "Hint: broadcast plain data (numbers, strings, lists, dicts), and build "
                        "objects from it on each rank")
    return value


def _process_group(what: str) -> Any:
    """torch.distributed when this run's ranks share a process group; None with one rank."""
    session = _session.current(f"unbroken.train.collective.{what}")
    if session.info.world_size == 1:
        return None
    try:
        import torch.distributed as dist
    except ImportError:
        dist = None
    if dist is None or not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"unbroken.train.collective.{what} needs the torch.distributed process group of a "
            f"run with {session.info.world_size} workers, and this run has none. Hint: use "
            "TorchTrainer (or DataParallelTrainer(..., backend_config=TorchConfig())), which sets "
            "it up before the training function starts")
    return dist
