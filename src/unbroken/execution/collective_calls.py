"""The driver's half of `train.collective` when the ranks share no process group: each call
is a `Gather` from every rank, and once all of them have made it, every rank gets the same
`Gathered` (rank 0's data). Pure: the controller sends what `add` returns.

The ranks must make the same calls in the same order, as with any collective. A rank that
calls `barrier()` where another calls `broadcast_from_rank_zero()` gets an error naming both,
on every rank, instead of a hang or a wrong value.
"""

from __future__ import annotations

from unbroken.worker.protocol import Gather, Gathered


class CollectiveCalls:
    """The collective calls of one attempt that not every rank has made yet."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self._waiting: dict[int, dict[int, Gather]] = {}  # seq -> rank -> its part

    def add(self, rank: int, part: Gather) -> Gathered | None:
        """Take rank `rank`'s part of call `part.seq`; the answer for every rank once it is the
        last rank to make that call, else None."""
        parts = self._waiting.setdefault(part.seq, {})
        parts[rank] = part
        if len(parts) < self.num_workers:
            return None
        del self._waiting[part.seq]
        return _answer(part.seq, parts)


def _answer(seq: int, parts: dict[int, Gather]) -> Gathered:
    ops = {part.op for part in parts.values()}
    if len(ops) > 1:
        calls = ", ".join(f"rank {rank}: {parts[rank].op}" for rank in sorted(parts))
        return Gathered(seq, mismatch=f"the ranks made different collective calls at call {seq + 1} "
                                      f"({calls}). Hint: every rank must make the same "
                                      "unbroken.train.collective calls in the same order")
    errors = [part.error for _, part in sorted(parts.items()) if part.error]
    if errors:
        return Gathered(seq, error=errors[0])
    return Gathered(seq, data=parts[0].data)
