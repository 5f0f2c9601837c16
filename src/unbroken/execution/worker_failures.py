"""What the controller makes of a failed worker group: the ranks' failures in the order they
happened (`record`), the root cause among them (`root_cause`), a rank's own exception
rebuilt on the driver with its remote traceback (`worker_exception`), and the
TrainingFailedError that fit() raises when the failure policy gives up (`give_up_error`).
"""

from __future__ import annotations

import cloudpickle

from unbroken.errors import (
    ControllerError,
    TrainingFailedError,
    WorkerDied,
    WorkerError,
    WorkerGroupError,
    WorkerHangError,
)
from unbroken.execution.engine.base import WorkerGroup
from unbroken.run.callbacks import failed_rank

# How long a rank's error waits for a peer's death to show, which would be the root cause.
ROOT_CAUSE_WAIT_S = 0.2


def give_up_error(error: Exception, message: str) -> TrainingFailedError:
    """What fit() raises when it gives up: WorkerGroupError when a rank raised, died or hung,
    ControllerError when the driver's own work failed (both are TrainingFailedErrors)."""
    rank = failed_rank(error)
    if rank >= 0 or isinstance(error, WorkerError):
        return WorkerGroupError(message, {rank: error})
    return ControllerError(message, error)


def first_line(error: BaseException) -> str:
    """`Type: first line of the message`, for one-line logs and messages."""
    text = str(error)
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def record(failures: list[tuple[int, BaseException]], rank: int, error: BaseException, at: float) -> None:
    """Add rank `rank`'s failure to `failures`, kept in the order the failures happened: `at`
    is when (the rank's clock for an error it sent, the driver's for a death it saw; a
    failure recorded without it, such as a hang, stays ahead). Messages of several ranks
    that reach the driver in one poll come in rank order, not in the order they were sent,
    and a rank whose own error (a full disk) ended its process group must stay ahead of the
    broken collectives of its peers."""
    error.failed_at = at  # type: ignore[attr-defined]
    index = len(failures)
    while index > 0 and getattr(failures[index - 1][1], "failed_at", 0.0) > at:
        index -= 1
    failures.insert(index, (rank, error))


def root_cause(group: WorkerGroup, failures: list[tuple[int, BaseException]]) -> BaseException:
    """The error to handle for a failed group: the first failure, unless a rank reported an
    error while a peer was killed (a signal: OOM, SIGKILL) or lost with its node: the error is
    then usually just the broken connection to that peer, and the loss is the root cause. A
    hang stays the root cause when the hung ranks were then killed (`in_place.free_hung`)."""
    rank, first = failures[0]
    if isinstance(first, WorkerHangError):
        return first
    if isinstance(first, WorkerDied):
        return WorkerError(str(first), rank=rank)
    for killed in group.lost_ranks(ROOT_CAUSE_WAIT_S):
        if killed.rank == rank:
            continue  # killed after its own error (e.g. let go by in-place recovery): not the cause
        error = WorkerError(f"{killed}; then rank {rank} failed with {first_line(first)}", rank=killed.rank)
        error.__cause__ = first
        return error
    return first


def worker_exception(rank: int, text: str, blob: bytes | None) -> BaseException:
    """The worker's own exception when it unpickles here (with the remote traceback attached)."""
    error: BaseException | None = None
    if blob is not None:
        try:
            error = cloudpickle.loads(blob)
        except Exception:
            error = None
    remote = WorkerError(f"worker rank {rank} raised", rank=rank, traceback_text=text)
    if error is None or not isinstance(error, Exception):
        return remote
    error.__cause__ = remote
    return error
