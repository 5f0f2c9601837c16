"""torch.distributed for TorchTrainer: the process group, and the helpers that put a model
and a DataLoader on it (prepare_model, prepare_data_loader, get_device).

prepare_data_loader makes a DataLoader resumable: a seeded global sample order per epoch,
shared out among the ranks (unbroken.state.sampler), with its position saved by TrainState, and
optionally per-sample seeding of the randomness in `__getitem__` (unbroken.state.sample_seed)."""

from __future__ import annotations

import datetime
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from unbroken.state.loader_workers import die_with_rank
from unbroken.state.sample_seed import KeyedSampler, SeededDataset, sample_seed
from unbroken.state.sampler import ResumableSampler
from unbroken.state.stream_loader import StreamLoader, kind_of
from unbroken.worker import dataset_shard
from unbroken.worker import session as session_mod
from unbroken.worker.backend import Backend, RendezvousFn
from unbroken.worker.forward_clock import ForwardClock
from unbroken.worker.session import Session


@dataclass
class TorchConfig:
    """The torch.distributed process group each worker joins ("gloo" on CPU, "nccl" on GPU)."""

    backend: Literal["gloo", "nccl"] | None = None
    timeout_s: int = 1800

    def __post_init__(self) -> None:
        if self.backend not in (None, "gloo", "nccl"):
            raise ValueError(f"TorchConfig.backend must be 'gloo' or 'nccl', got {self.backend!r}")

    def make_backend(self) -> TorchBackend:
        return TorchBackend(self)


class TorchBackend(Backend):
    def __init__(self, config: TorchConfig) -> None:
        self.config = config

    def on_start(self, session: Session, rendezvous: RendezvousFn) -> None:
        info = session.info
        if info.use_gpu and torch.cuda.is_available():
            torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
        backend = self.config.backend or ("nccl" if info.use_gpu else "gloo")
        timeout = datetime.timedelta(seconds=self.config.timeout_s)
        # Rank 0 binds a free port itself and tells the others where it is, on its node's
        # address: no port race on a busy machine. One worker gets a group too, as in Ray: loops
        # call torch.distributed, and frameworks rendezvous at MASTER_ADDR/MASTER_PORT.
        if info.world_size == 1:
            store = dist.TCPStore(info.node_address, 0, 1, is_master=True, timeout=timeout,
                                  wait_for_workers=False)
            host, port = info.node_address, store.port
        elif info.world_rank == 0:
            store = dist.TCPStore(info.node_address, 0, info.world_size, is_master=True,
                                  timeout=timeout, wait_for_workers=False)
            host, port = rendezvous((info.node_address, store.port))
        else:
            host, port = rendezvous(None)
            store = dist.TCPStore(host, port, info.world_size, is_master=False, timeout=timeout)
        os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port))
        collectives = min(self.config.timeout_s, info.collective_timeout_s or self.config.timeout_s)
        dist.init_process_group(backend, store=store, rank=info.world_rank, world_size=info.world_size,
                                timeout=datetime.timedelta(seconds=collectives))

    def on_shutdown(self, session: Session) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def get_device() -> torch.device:
    """This worker's device: its GPU when the run uses GPUs, else the CPU."""
    info = session_mod.current("get_device()").info
    if info.use_gpu and torch.cuda.is_available():
        return torch.device("cuda", info.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def prepare_model(model: torch.nn.Module, move_to_device: bool = True,
                  parallel_strategy: Literal["ddp"] | None = "ddp",
                  parallel_strategy_kwargs: dict[str, Any] | None = None) -> torch.nn.Module:
    """Move the model to this worker's device and wrap it in DistributedDataParallel (timing
    its forward passes, which name a rank slower than the others: `forward_clock`)."""
    device = get_device()
    if move_to_device:
        model = model.to(device)
    if parallel_strategy == "ddp" and dist.is_initialized() and dist.get_world_size() > 1:
        kwargs = dict(parallel_strategy_kwargs or {})
        if device.type == "cuda":
            kwargs.setdefault("device_ids", [device.index])
        session = session_mod.current("prepare_model()")
        if session.info.peer_source is not None:
            # Recovering in place: a peer sends the state, and ranks whose loop stayed wrap their
            # model again without collectives (`worker.recovery.in_loop`), so this one makes none either.
            kwargs["init_sync"] = False
        model = torch.nn.parallel.DistributedDataParallel(model, **kwargs)
        model.unbroken_ddp_kwargs = kwargs
        session.wrapped(model, ForwardClock(model.module, device))
    return model


def _to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


class DeviceDataLoader:
    """A DataLoader that prepare_data_loader could not make resumable (see `why_not_resumable`),
    iterated on this worker's device. A DistributedSampler in it gets its epoch set each pass."""

    def __init__(self, loader: DataLoader, device: torch.device, why_not_resumable: str) -> None:
        self._loader = loader
        self._device = device
        self._epoch = 0
        self.why_not_resumable = why_not_resumable

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._loader, name)

    def set_epoch(self, epoch: int) -> None:
        """Use `epoch`'s sample order for the next pass."""
        self._epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        sampler = self._loader.sampler
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(self._epoch)
        self._epoch += 1
        for batch in self._loader:
            yield _to_device(batch, self._device)


class ResumableDataLoader:
    """What prepare_data_loader returns: a DataLoader over this rank's share of a seeded
    global sample order (`ResumableSampler`), on this worker's device, whose position
    (epoch, samples consumed) `state_dict()` saves and `load_state_dict()` restores.

    Iterating it continues the current epoch from the current position; a pass that runs to
    its end moves to the next epoch. Consumption is counted by the batches handed to the
    training loop, not by what DataLoader workers have prefetched. Anything else (`dataset`
    aside) is read from the underlying DataLoader.
    """

    def __init__(self, loader: DataLoader, sampler: ResumableSampler, dataset: Any,
                 device: torch.device, generator: torch.Generator) -> None:
        self._loader = loader
        self._sampler = sampler
        self._dataset = dataset
        self._device = device
        self._generator = generator

    @property
    def sampler(self) -> ResumableSampler:
        return self._sampler

    @property
    def dataset(self) -> Any:
        """The dataset as it was given (without the per-sample seeding wrapper), or, for a shard
        of `train.get_dataset_shard`, the dataset it was cut from."""
        return self._dataset

    @property
    def epoch(self) -> int:
        """The epoch the next pass continues (it advances when a pass runs to its end)."""
        return self._sampler.epoch

    @property
    def seeds_per_sample(self) -> bool:
        """True when each sample is fetched with generators seeded from (seed, epoch, index)."""
        return isinstance(self._loader.dataset, SeededDataset)

    def __len__(self) -> int:
        """Batches in a whole epoch on this rank (a pass resumed mid-epoch yields fewer)."""
        per_rank = self._sampler.epoch_length()
        batch = self._loader.batch_size or 1
        return per_rank // batch if self._loader.drop_last else -(-per_rank // batch)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._loader, name)

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of `epoch`; the current epoch keeps its position, so calling
        this at the top of an epoch loop does not undo a mid-epoch resume."""
        self._sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The data position (see ResumableSampler.state_dict)."""
        return self._sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved data position, with this run's number of ranks."""
        self._sampler.load_state_dict(state)

    def __iter__(self) -> Iterator[Any]:
        sampler = self._sampler
        # DataLoader draws its workers' base seed from this generator, not from the rank's
        # global one, so starting a pass (fresh or resumed) leaves the training RNG untouched.
        self._generator.manual_seed(sample_seed(sampler.seed, sampler.epoch, sampler.position))
        remaining = len(sampler)
        batch_size = self._loader.batch_size or 1
        for batch in self._loader:
            taken = min(batch_size, remaining)
            remaining -= taken
            sampler.advance(taken)
            yield _to_device(batch, self._device)
        sampler.end_epoch()


def worker_ranks() -> tuple[int, int]:
    """(rank, world size) of this worker: from the session, else torch.distributed, else (0, 1)."""
    session = session_mod.active()
    if session is not None:
        return session.info.world_rank, session.info.world_size
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


_KNOWN_SAMPLERS = (RandomSampler, SequentialSampler, DistributedSampler)


def _why_not_resumable(loader: DataLoader, add_dist_sampler: bool, world_size: int) -> str | None:
    if isinstance(loader.dataset, IterableDataset):
        return ("it reads an IterableDataset without state_dict()/load_state_dict(), whose position "
                "cannot be saved; read it through torchdata's StatefulDataLoader, or give the dataset "
                "state_dict() and load_state_dict()")
    if not add_dist_sampler:
        return "prepare_data_loader was called with add_dist_sampler=False, which keeps its own sampler"
    if loader.batch_size is None and loader.batch_sampler is not None:
        return "it has its own batch_sampler"
    if not getattr(loader, "in_order", True):
        return "it yields batches out of order (in_order=False)"
    if world_size == 1 and type(loader.sampler) not in _KNOWN_SAMPLERS:
        return (f"it has its own sampler ({type(loader.sampler).__name__}); with one worker "
                "prepare_data_loader keeps it")
    if isinstance(loader.sampler, RandomSampler) and (loader.sampler.replacement
                                                      or loader.sampler._num_samples is not None) \
            and world_size == 1:
        return "its RandomSampler draws with replacement or a custom num_samples"
    return None


def prepare_data_loader(data_loader: DataLoader, add_dist_sampler: bool = True,
                        move_to_device: bool = True, *, seed: int | None = None,
                        seed_per_sample: bool | None = None,
                        global_batch_size: int | None = None
                        ) -> ResumableDataLoader | DeviceDataLoader | DataLoader:
    """Give each rank its share of the data, in a resumable order, on its device.

    The loader's sampler becomes a `ResumableSampler`: one seeded permutation of the dataset
    per epoch (no permutation for a SequentialSampler), shared out among the ranks, whose
    position TrainState saves and restores, so a resumed run continues mid-epoch with the next
    unseen samples, with any number of ranks. Any sampler other than the default ones is
    replaced when there are several ranks, as in Ray Train; with one rank it is kept and the
    loader is not resumable. A shard from `train.get_dataset_shard` is this rank's part already:
    the sampler shares out the dataset it was cut from instead of splitting the shard again.

    `seed`: the sample order's seed; default: a DistributedSampler's seed, else the
    DataLoader's `generator` seed, else 0. `seed_per_sample`: seed python's `random`, numpy
    and torch before each sample is fetched, from (seed, epoch, index), so augmentation does
    not depend on `num_workers` or the resume point (see `unbroken.state.sample_seed`). The default,
    None, does it when `num_workers > 0`, where it is needed for an exact resume; with
    `num_workers=0` samples are fetched in the training process, whose generators TrainState
    saves, so an exact resume needs no per-sample seeding there.

    `global_batch_size`: the samples one step takes across all ranks. Each rank's batches
    then hold `global_batch_size / world_size` samples, whatever the DataLoader's
    `batch_size`, so every optimizer step sees the same number of samples at any number of
    workers: what an elastic run (`ScalingConfig(num_workers=(min, max))`) needs to stay the
    same training when it resizes. It must be divisible by every world size the run takes.

    A loader over an IterableDataset is not split again (split it per rank yourself, e.g. with
    `datasets.distributed.split_dataset_by_node`, as in Ray Train): when it can keep a position
    (a torchdata `StatefulDataLoader`, or a dataset with `state_dict()`/`load_state_dict()`)
    the same loader is returned, moving its batches to the device and resumable per rank
    (`unbroken.state.stream_loader`).

    Returns a `ResumableDataLoader`, that stream loader, or a `DeviceDataLoader` (whose
    `why_not_resumable` says why) for loaders it cannot make resumable: an IterableDataset
    without a state, a custom batch_sampler, `in_order=False`, or `add_dist_sampler=False`.
    """
    if not isinstance(data_loader, DataLoader):
        raise TypeError(f"prepare_data_loader needs a torch.utils.data.DataLoader, got "
                        f"{type(data_loader).__name__}. Hint: wrap your dataset: "
                        "prepare_data_loader(DataLoader(dataset, batch_size=..., shuffle=True))")
    device = get_device() if move_to_device else torch.device("cpu")
    rank, world_size = worker_ranks()
    per_rank = _per_rank_batch(global_batch_size, world_size)
    if isinstance(data_loader.dataset, IterableDataset) and kind_of(data_loader) is not None:
        if per_rank is not None:
            streamed = type(data_loader.dataset).__name__
            raise ValueError("prepare_data_loader(global_batch_size=...) shares out a map-style dataset; "
                             f"this loader streams an IterableDataset ({streamed}), "
                             "whose batches are as its DataLoader makes them. Hint: set the DataLoader's "
                             "batch_size to the global batch size divided by the number of workers")
        stream = StreamLoader.of(data_loader, world_size)
        stream.move = None if device.type == "cpu" else functools.partial(_to_device, device=device)
        return data_loader
    reason = _why_not_resumable(data_loader, add_dist_sampler, world_size)
    if reason is not None and per_rank is not None:
        raise ValueError(f"prepare_data_loader(global_batch_size=...) needs a loader it can make "
                         f"resumable, and this one is not: {reason}")
    if reason is not None:
        data_loader.worker_init_fn = die_with_rank(data_loader)
        return DeviceDataLoader(data_loader, device, reason)

    old = data_loader.sampler
    # A shard from train.get_dataset_shard is this rank's part already: share out the whole
    # dataset it was cut from rather than split the part again.
    dataset = dataset_shard.whole_of(data_loader.dataset)
    if dataset is None:
        dataset = data_loader.dataset
    shuffle = not isinstance(old, SequentialSampler)
    drop_last_share = False
    if isinstance(old, DistributedSampler):
        shuffle, drop_last_share = old.shuffle, old.drop_last
    if seed is None:
        if isinstance(old, DistributedSampler):
            seed = old.seed
        elif data_loader.generator is not None:
            seed = data_loader.generator.initial_seed()
        else:
            seed = 0
    sampler = ResumableSampler(len(dataset), num_replicas=world_size, rank=rank, shuffle=shuffle,
                               seed=seed, drop_last=drop_last_share)
    if seed_per_sample is None:
        seed_per_sample = data_loader.num_workers > 0
    generator = torch.Generator()
    kwargs = loader_kwargs(data_loader)
    kwargs.update(worker_init_fn=die_with_rank(data_loader), generator=generator)
    if per_rank is not None:
        kwargs["batch_size"] = per_rank
    if seed_per_sample:
        loader = DataLoader(SeededDataset(dataset, seed), sampler=KeyedSampler(sampler), **kwargs)
    else:
        loader = DataLoader(dataset, sampler=sampler, **kwargs)
    return ResumableDataLoader(loader, sampler, dataset, device, generator)


def _per_rank_batch(global_batch_size: int | None, world_size: int) -> int | None:
    if global_batch_size is None:
        return None
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValueError(f"prepare_data_loader(global_batch_size={global_batch_size!r}) must be an int >= 1")
    if global_batch_size % world_size:
        raise ValueError(
            f"prepare_data_loader(global_batch_size={global_batch_size}) cannot be shared out evenly "
            f"among {world_size} workers. Hint: pick a global batch size divisible by every world size "
            "the run takes, e.g. a multiple of the least common multiple of min_workers..max_workers")
    return global_batch_size // world_size


def loader_kwargs(loader: DataLoader) -> dict[str, Any]:
    """The arguments `loader` was built with, but its dataset and sampler: to build the same
    loader over another dataset or sampler."""
    kwargs: dict[str, Any] = dict(
        batch_size=loader.batch_size, collate_fn=loader.collate_fn, num_workers=loader.num_workers,
        pin_memory=loader.pin_memory, drop_last=loader.drop_last, timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn, generator=loader.generator,
        multiprocessing_context=loader.multiprocessing_context, persistent_workers=loader.persistent_workers)
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    if loader.pin_memory_device:
        kwargs["pin_memory_device"] = loader.pin_memory_device
    if not getattr(loader, "in_order", True):
        kwargs["in_order"] = False
    return kwargs
