"""torch.distributed for TorchTrainer: the process group, and the helpers that put a model
and a DataLoader on it (prepare_model, prepare_data_loader, get_device)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from unbroken import session as session_mod
from unbroken.backend import Backend, Rendezvous
from unbroken.session import Session


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

    def on_start(self, session: Session, rendezvous: Rendezvous) -> None:
        info = session.info
        if info.use_gpu and torch.cuda.is_available():
            torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
        if info.world_size == 1:
            return
        backend = self.config.backend or ("nccl" if info.use_gpu else "gloo")
        timeout = datetime.timedelta(seconds=self.config.timeout_s)
        # Rank 0 binds a free port itself and tells the others: no port race on a busy machine.
        if info.world_rank == 0:
            store = dist.TCPStore("127.0.0.1", 0, info.world_size, is_master=True,
                                  timeout=timeout, wait_for_workers=False)
            port = rendezvous(store.port)
        else:
            port = rendezvous(None)
            store = dist.TCPStore("127.0.0.1", port, info.world_size, is_master=False, timeout=timeout)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group(backend, store=store, rank=info.world_rank,
                                world_size=info.world_size, timeout=timeout)

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
    """Move the model to this worker's device and wrap it in DistributedDataParallel."""
    device = get_device()
    if move_to_device:
        model = model.to(device)
    if parallel_strategy == "ddp" and dist.is_initialized() and dist.get_world_size() > 1:
        kwargs = dict(parallel_strategy_kwargs or {})
        if device.type == "cuda":
            kwargs.setdefault("device_ids", [device.index])
        model = torch.nn.parallel.DistributedDataParallel(model, **kwargs)
    return model


class _DeviceLoader:
    """Iterates a DataLoader on this worker's device, setting the sampler's epoch each pass."""

    def __init__(self, loader: DataLoader, device: torch.device) -> None:
        self._loader = loader
        self._device = device
        self._epoch = 0

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def set_epoch(self, epoch: int) -> None:
        """Use `epoch`'s sample order for the next pass (call it when resuming mid-training)."""
        self._epoch = epoch

    def __iter__(self):
        sampler = self._loader.sampler
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(self._epoch)
        self._epoch += 1
        for batch in self._loader:
            yield _to_device(batch, self._device)


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


def prepare_data_loader(data_loader: DataLoader, add_dist_sampler: bool = True,
                        move_to_device: bool = True) -> Any:
    """Give each rank its part of the data (a seeded DistributedSampler) on its device."""
    loader = data_loader
    if add_dist_sampler and dist.is_initialized() and dist.get_world_size() > 1 \
            and not isinstance(data_loader.sampler, DistributedSampler):
        shuffle = not isinstance(data_loader.sampler, torch.utils.data.SequentialSampler)
        sampler = DistributedSampler(data_loader.dataset, num_replicas=dist.get_world_size(),
                                     rank=dist.get_rank(), shuffle=shuffle)
        loader = DataLoader(data_loader.dataset, batch_size=data_loader.batch_size, sampler=sampler,
                            num_workers=data_loader.num_workers, collate_fn=data_loader.collate_fn,
                            pin_memory=data_loader.pin_memory, drop_last=data_loader.drop_last,
                            worker_init_fn=data_loader.worker_init_fn,
                            generator=data_loader.generator)
    return _DeviceLoader(loader, get_device() if move_to_device else torch.device("cpu"))
