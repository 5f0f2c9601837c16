"""Per-sample seeding: randomness inside a dataset's `__getitem__` (data augmentation) as a
function of (seed, epoch, sample index).

Why: DataLoader worker processes are started afresh for every pass, and which worker fetches
which batch depends on where the pass started. A worker's random stream therefore depends on
the resume point and on `num_workers`, and a resumed run would augment its samples
differently from the uninterrupted one. Seeding python's `random`, numpy's global RNG and
torch's CPU generator from `sample_seed(seed, epoch, index)` just before each sample is
fetched makes a sample's augmentation in an epoch the same whichever process fetches it,
however many DataLoader workers or training ranks there are, and wherever the run resumed.

In a DataLoader worker process the generators belong to the data pipeline alone, so they are
simply re-seeded. In the training process itself (`num_workers=0`) the rank's own generators
are saved before a batch is fetched and put back afterwards, so fetching data does not move
the random stream that dropout and the rest of the training step draw from.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler, get_worker_info

from unbroken.state.sampler import ResumableSampler

try:
    import numpy as _np
except ImportError:  # pragma: no cover - numpy is optional
    _np = None

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a cheap bijection that spreads every input bit over the output."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The 64-bit seed of sample `index` in `epoch` (call it to reproduce one sample's draw)."""
    return _mix64(_mix64(_mix64(seed & _MASK64) ^ (epoch & _MASK64)) ^ (index & _MASK64))


def seed_generators(seed: int) -> None:
    """Seed python's `random`, numpy's global RNG (if numpy is installed) and torch's CPU
    generator from one 64-bit seed. CUDA generators are left alone."""
    random.seed(seed)
    torch.random.default_generator.manual_seed(seed)
    if _np is not None:
        _np.random.seed((seed ^ (seed >> 32)) & 0xFFFFFFFF)


class KeyedSampler(Sampler[tuple[int, int]]):
    """Wraps a ResumableSampler to yield (epoch, index) keys that SeededDataset understands."""

    def __init__(self, sampler: ResumableSampler) -> None:
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.sampler.epoch
        return ((epoch, index) for index in self.sampler.indices())


class SeededDataset(Dataset):
    """A map-style dataset fetched by (epoch, index) keys, seeding the generators per sample.

    The wrapped dataset's `__getitem__` is called with plain indices; its own `__getitems__`,
    if it has one, is bypassed, since each sample needs its own seed.
    """

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset = dataset
        self.seed = int(seed)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        if name in ("dataset", "seed") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def _fetch(self, keys: list[tuple[int, int]]) -> list[Any]:
        out = []
        for epoch, index in keys:
            seed_generators(sample_seed(self.seed, epoch, index))
            out.append(self.dataset[index])
        return out

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[Any]:
        if get_worker_info() is not None:
            return self._fetch(keys)
        saved = (random.getstate(), torch.get_rng_state(),
                 _np.random.get_state() if _np is not None else None)
        try:
            return self._fetch(keys)
        finally:
            random.setstate(saved[0])
            torch.set_rng_state(saved[1])
            if saved[2] is not None:
                _np.random.set_state(saved[2])

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self.__getitems__([key])[0]
