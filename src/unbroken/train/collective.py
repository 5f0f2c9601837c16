"""Collective operations across the ranks of a run, as Ray Train V2's `ray.train.collective`.

They run over the torch.distributed process group when the ranks share one (`TorchTrainer`,
or a `DataParallelTrainer` with `backend_config=TorchConfig()`), and through the driver
otherwise (any other trainer, or before the group exists): the same calls work in every
trainer, as in Ray. Through the driver each call costs a message each way per rank, and the
data passes through the driver: meant for small objects (Ray documents about 1 KB); a larger
one works but is logged once. Every rank must call them, in the same order, like any
collective; ranks that make different calls get an error instead of a hang. With one worker
they return at once, and outside a training function they raise with a hint.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any, TypeVar

from unbroken.worker import session as _session

__all__ = ["barrier", "broadcast_from_rank_zero"]

T = TypeVar("T")

log = logging.getLogger("unbroken")

LARGE_BYTES = 1 << 20  # through the driver, data above this is logged (once) as better sent otherwise
_warned_large = False


def barrier() -> None:
    """Wait until every rank has called `barrier()`."""
    session = _session.current("unbroken.train.collective.barrier()")
    if session.info.world_size == 1:
        return
    dist = _process_group()
    if dist is not None:
        dist.barrier()
        return
    _check(session.gather("barrier()"))


def broadcast_from_rank_zero(data: T) -> T:
    """Rank 0's `data` on every rank (what other ranks pass is ignored). Also a barrier.

    `data` must pickle; if rank 0's does not, every rank raises the same TypeError instead
    of waiting forever for it.
    """
    session = _session.current("unbroken.train.collective.broadcast_from_rank_zero()")
    if session.info.world_size == 1:
        return data
    dist = _process_group()
    if dist is None:
        return _broadcast_through_driver(session, data)
    message: list[Any] = [None]
    if dist.get_rank() == 0:
        blob, error = _pickled(data)
        message = [(True, data)] if blob is not None else [(False, error)]
    dist.broadcast_object_list(message, src=0)
    ok, value = message[0]
    if not ok:
        raise TypeError(_unpicklable(value))
    return value


def _broadcast_through_driver(session: Any, data: Any) -> Any:
    global _warned_large
    if session.info.world_rank != 0:
        return pickle.loads(_check(session.gather("broadcast_from_rank_zero()")))
    blob, error = _pickled(data)
    if blob is not None and len(blob) > LARGE_BYTES and not _warned_large:
        _warned_large = True
        log.warning("broadcast_from_rank_zero: %d bytes go through the driver, as this run's ranks "
                    "share no process group. Hint: use TorchTrainer for large data, or write it to "
                    "storage and broadcast its path", len(blob))
    _check(session.gather("broadcast_from_rank_zero()", blob, error))
    return data


def _pickled(data: Any) -> tuple[bytes | None, str]:
    """`data` pickled, or why it cannot be."""
    try:
        return pickle.dumps(data), ""
    except Exception as e:  # pickle raises many kinds: report them all the same way
        return None, f"{type(e).__name__}: {e}"


def _unpicklable(why: str) -> str:
    return (f"broadcast_from_rank_zero: rank 0's data cannot be pickled ({why}). Hint: broadcast "
            "plain data (numbers, strings, lists, dicts), and build objects from it on each rank")


def _check(answer: Any) -> bytes | None:
    """The data of the driver's answer to a collective call; raises the error it carries (the
    same on every rank)."""
    if answer.mismatch:
        raise RuntimeError(f"unbroken.train.collective: {answer.mismatch}")
    if answer.error:
        raise TypeError(_unpicklable(answer.error))
    return answer.data


def _process_group() -> Any:
    """torch.distributed when this run's ranks share a process group, else None."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist
