"""DataLoader worker processes that die with their rank.

A DataLoader worker is forked from its rank and inherits its file descriptors: the pipe that
tells the driver the rank is alive, and the sockets of its process group. While a worker lives
on after its rank, the driver does not see the rank die, and a peer blocked in a collective
with it is not released (gloo notices a peer's end only when every copy of its socket is
closed). torch's workers check for a dead parent only every few seconds; this makes the kernel
kill them with the rank.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader


class _DieWithRank:
    """A DataLoader `worker_init_fn` that makes the worker process die with its rank.

    A DataLoader worker inherits its rank's end of the pipe that tells the driver the rank is
    alive, so a rank killed with SIGKILL is only noticed once its DataLoader workers are gone,
    and they only check for a dead parent every few seconds. With PR_SET_PDEATHSIG the kernel
    kills them with the rank, so the driver notices at once. Runs the user's function after.
    """

    def __init__(self, user_fn: Any) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        try:
            import ctypes
            import signal

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # not Linux
            pass
        if self.user_fn is not None:
            self.user_fn(worker_id)


def die_with_rank(loader: DataLoader) -> Any:
    """The `worker_init_fn` for `loader`: its own, run after making the worker die with its rank
    (unchanged without worker processes, or when done already)."""
    fn = loader.worker_init_fn
    if loader.num_workers == 0 or isinstance(fn, _DieWithRank):
        return fn
    return _DieWithRank(fn)
