"""ResumableSampler: the order in which a run visits its samples, and how far it has got.

Each epoch has one *global* order: a permutation of the whole dataset seeded by
`seed + epoch` (the same permutation `DistributedSampler` uses), or 0..n-1 without shuffling.
The ranks share that order out by interleaving: rank r takes global positions r, r+W, r+2W, ...
(W = number of ranks). So when every rank has consumed m samples, the run as a whole has
consumed exactly the first m*W positions of the global order, and that one number is the
data position a checkpoint needs.

The position survives a change in the number of ranks: a run resumed with W' ranks shares out
the rest of the epoch's global order among W' ranks, so each sample is still seen once per
epoch. With the same W the resumed run rebuilds exactly the layout it had, padding included,
so it yields exactly the batches the uninterrupted run would have.

A *segment* is the stretch of an epoch that one layout covers: from `segment_start` (a global
position) to the end of the epoch, shared by `segment_world_size` ranks. An epoch has one
segment unless the number of ranks changed in the middle of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from unbroken.errors import StateMismatchError

STATE_VERSION = 1


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The global sample order of one epoch: the same for every rank and every attempt."""
    if not shuffle:
        return list(range(num_samples))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=g).tolist()


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class ResumableSampler(Sampler[int]):
    """Yields this rank's share of the epoch's global order, from the current position on.

    The loader that owns it calls `advance(n)` for every batch it hands to the training loop
    (not for what DataLoader workers prefetched) and `end_epoch()` after a complete pass;
    `state_dict()` / `load_state_dict()` carry the position through a checkpoint.

    `drop_last=False` (the default) pads each rank's share to the same length by repeating
    the segment's first samples, as `DistributedSampler` does, so that every rank runs the
    same number of steps; `drop_last=True` drops the tail instead.
    """

    def __init__(self, num_samples: int, *, num_replicas: int = 1, rank: int = 0, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False) -> None:
        if not isinstance(num_samples, int) or num_samples < 0:
            raise ValueError(f"ResumableSampler needs a dataset length >= 0, got {num_samples!r}")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"ResumableSampler: rank {rank} is not in 0..{num_replicas - 1}")
        self.num_samples = num_samples
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self._epoch = 0
        self._segment_start = 0
        self._consumed = 0  # samples this rank has consumed in the current segment

    @property
    def epoch(self) -> int:
        """The epoch whose order the next pass continues."""
        return self._epoch

    @property
    def position(self) -> int:
        """How many samples of the current epoch's global order the run has consumed."""
        return min(self._segment_start + self._consumed * self.num_replicas, self.num_samples)

    def set_epoch(self, epoch: int) -> None:
        """Continue `epoch`: a different epoch starts at its beginning; the current one is kept
        where it is (so the usual `loader.set_epoch(epoch)` at the top of an epoch loop does not
        undo a mid-epoch resume)."""
        if epoch != self._epoch:
            self._epoch = int(epoch)
            self._segment_start = 0
            self._consumed = 0

    def epoch_length(self) -> int:
        """This rank's number of samples in a whole epoch (from position 0)."""
        return self._share(self.num_samples)

    def _share(self, remaining: int) -> int:
        if self.drop_last:
            return remaining // self.num_replicas
        return _ceil_div(remaining, self.num_replicas)

    def __len__(self) -> int:
        """This rank's samples left in the current pass."""
        return self._share(self.num_samples - self._segment_start) - self._consumed

    def indices(self) -> list[int]:
        """This rank's remaining indices of the current epoch, in order."""
        rest = epoch_order(self.num_samples, self.seed, self._epoch, self.shuffle)[self._segment_start:]
        total = self._share(len(rest)) * self.num_replicas
        if total > len(rest):
            padding = total - len(rest)
            rest += (rest * _ceil_div(padding, len(rest)))[:padding]
        return rest[self.rank:total:self.num_replicas][self._consumed:]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices())

    def advance(self, count: int) -> None:
        """Record that the training loop received `count` more samples of this rank's share."""
        self._consumed = min(self._consumed + count, self._share(self.num_samples - self._segment_start))

    def end_epoch(self) -> None:
        """A pass ran to its end: the next pass is the next epoch, from its beginning."""
        self._epoch += 1
        self._segment_start = 0
        self._consumed = 0

    def state_dict(self) -> dict[str, Any]:
        """The data position, in plain ints and bools (loads with torch.load(weights_only=True))."""
        return {"version": STATE_VERSION, "epoch": self._epoch, "position": self.position,
                "segment_start": self._segment_start, "segment_world_size": self.num_replicas,
                "consumed": self._consumed, "num_samples": self.num_samples, "seed": self.seed,
                "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position. With the number of ranks the state was saved with,
        the saved layout is rebuilt exactly; with another number, the rest of the epoch is
        shared out anew from the saved global position."""
        missing = {"epoch", "position", "segment_start", "segment_world_size", "consumed", "num_samples",
                   "seed", "shuffle"} - set(state)
        if missing:
            raise StateMismatchError(f"the saved data position lacks {sorted(missing)}; it was not "
                                     "written by ResumableSampler.state_dict()")
        for key, now in (("num_samples", self.num_samples), ("seed", self.seed),
                         ("shuffle", self.shuffle), ("drop_last", self.drop_last)):
            saved = state.get(key, now)
            if saved != now:
                raise StateMismatchError(
                    f"the checkpoint's data order was made with {key}={saved!r}, but this loader has "
                    f"{key}={now!r}, so the saved position does not point into this order. Hint: "
                    f"resume with the same dataset and prepare_data_loader settings ({key}={saved!r}), "
                    "or start a new run")
        self._epoch = int(state["epoch"])
        if int(state["segment_world_size"]) == self.num_replicas:
            self._segment_start = int(state["segment_start"])
            self._consumed = int(state["consumed"])
        else:
            self._segment_start = int(state["position"])
            self._consumed = 0
