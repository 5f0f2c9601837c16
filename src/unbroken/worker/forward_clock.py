"""How long this rank spends in its model's forward pass: the part of a data-parallel step
that no collective waits in, so the one figure in which a slow rank shows itself.

In a DistributedDataParallel run every rank's step takes as long as the slowest rank's: the
others wait for it in the gradient all-reduce. Time between reports is the same on every rank
and names nobody. The forward pass of the wrapped module runs no collective (DDP syncs
buffers before it and gradients after it), so its duration is this rank's own speed.
`prepare_model` attaches a clock to the module it wraps; each report carries the seconds
measured since the previous one (`Report.forward_s`), and the driver compares the ranks
(`unbroken.execution.stragglers`).

On a GPU the forward pass only queues kernels, so the clock records CUDA events and reads
them at the report, by which time the step's all-reduce has waited for them anyway.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class ForwardClock:
    """Sums the durations of `module`'s forward passes between two `take`s. A copy of the
    module (deepcopy, pickle) carries a clock of its own that nobody reads; a forward pass
    traced by torch.compile is not timed (no graph break for it)."""

    def __init__(self, module: torch.nn.Module, device: torch.device) -> None:
        self.__setstate__({"_cuda": device.type == "cuda"})
        self._handles = [module.register_forward_pre_hook(self._begin),
                         module.register_forward_hook(self._end)]

    def __getstate__(self) -> dict[str, Any]:
        return {"_cuda": self._cuda}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._cuda: bool = state["_cuda"]
        self._started: float | None = None
        self._events: list[tuple[Any, Any]] = []
        self._open: Any = None
        self._seconds = 0.0
        self.passes = 0
        self._handles: list[Any] = []

    def _begin(self, *_: Any) -> None:
        if torch.compiler.is_compiling():
            return
        if self._cuda:
            self._open = torch.cuda.Event(enable_timing=True)
            self._open.record()
        else:
            self._started = time.perf_counter()

    def _end(self, *_: Any) -> None:
        if torch.compiler.is_compiling():
            return
        if self._cuda and self._open is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._open, end))
            self._open = None
        elif self._started is not None:
            self._seconds += time.perf_counter() - self._started
            self._started = None
        else:
            return
        self.passes += 1

    def take(self) -> float | None:
        """The forward seconds since the previous take (None when no forward pass ran), and
        start counting again."""
        if not self.passes:
            return None
        seconds = self._seconds
        for start, end in self._events:
            end.synchronize()
            seconds += start.elapsed_time(end) / 1000.0
        self._seconds, self._events, self.passes = 0.0, [], 0
        return seconds

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
