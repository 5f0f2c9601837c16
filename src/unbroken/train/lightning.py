"""PyTorch Lightning inside `train_loop_per_worker`, with Ray Train's `ray.train.lightning` names.

A Ray script ports by changing its imports::

    from unbroken.train.lightning import (RayDDPStrategy, RayLightningEnvironment,
                                          RayTrainReportCallback, prepare_trainer)

`RayTrainReportCallback` reports `trainer.callback_metrics` and a Lightning checkpoint at the
end of every training epoch, in Ray's layout (`checkpoint_00000N/checkpoint.ckpt`). Beside it,
each rank saves its random generators (`rng_rank<k>.pt`), which Lightning's own checkpoint
leaves out; the callback puts them back when `trainer.fit(..., ckpt_path=...)` resumes from
such a checkpoint, so a resumed run goes on with the same dropout masks and data order as one
that never stopped. `fit_or_resume(trainer, model, ...)` is that resume in one call.

Lightning is imported when this module is; `pip install 'unbroken[lightning]'` installs it.
Both package spellings work: `lightning` (used when installed) and `pytorch_lightning`.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import random
import tempfile
import zlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from unbroken import train
from unbroken.core import ray_names as _ray_names
from unbroken.errors import CheckpointConflictError, UnsupportedOptionError
from unbroken.store.checkpoint import Checkpoint
from unbroken.train import collective
from unbroken.worker import dataset_shard
from unbroken.worker.torch_backend import get_device, loader_kwargs


def _import_lightning() -> Any:
    try:
        import lightning.pytorch as pl
    except ModuleNotFoundError:
        try:
            import pytorch_lightning as pl
        except ModuleNotFoundError:
            raise ModuleNotFoundError(
                "unbroken.train.lightning needs PyTorch Lightning, which is not installed. "
                "Hint: pip install 'unbroken[lightning]'") from None
    return pl


log = logging.getLogger("unbroken")
pl = _import_lightning()
_environments = importlib.import_module(f"{pl.__name__}.plugins.environments")

__all__ = ["RayDDPStrategy", "RayFSDPStrategy", "RayLightningEnvironment", "RayTrainReportCallback",
           "checkpoint_path", "fit_or_resume", "prepare_trainer"]


def __getattr__(name: str) -> Any:
    _ray_names.refuse(__name__, name)  # a Ray name unbroken does not provide: says what instead


class _UnbrokenPlacement:
    """Where Lightning puts the model and how it shards the data: this worker's device, and one
    replica per rank of the run."""

    @property
    def root_device(self) -> torch.device:
        return get_device()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def process_dataloader(self, dataloader: object) -> object:
        return super().process_dataloader(_whole_dataset(dataloader))  # type: ignore[misc]


def _whole_dataset(loader: Any) -> Any:
    """`loader` as Lightning made it; but where its distributed sampler would split a shard of
    `train.get_dataset_shard` (this rank's part already: each rank would see 1/world² of the
    data), the same loader over the dataset the shard was cut from, which the sampler shares
    out among the ranks as Lightning does with any dataset."""
    sampler = getattr(loader, "sampler", None)
    whole = dataset_shard.whole_of(getattr(loader, "dataset", None))
    if whole is None or not isinstance(sampler, DistributedSampler):
        return loader
    if type(sampler) is not DistributedSampler or type(loader.batch_sampler) is not BatchSampler:
        custom = sampler if type(sampler) is not DistributedSampler else loader.batch_sampler
        raise UnsupportedOptionError(
            f"a DataLoader over a shard of train.get_dataset_shard uses {type(custom).__name__}, which "
            "Lightning's distributed sampler would split again (each rank would see 1/world² of the "
            "data). Hint: give the DataLoader the whole dataset, or pass use_distributed_sampler=False "
            "to the Trainer to keep each rank on its shard")
    sampler = DistributedSampler(whole, num_replicas=sampler.num_replicas, rank=sampler.rank,
                                 shuffle=sampler.shuffle, seed=sampler.seed, drop_last=sampler.drop_last)
    return DataLoader(whole, sampler=sampler, **loader_kwargs(loader))


class RayDDPStrategy(_UnbrokenPlacement, pl.strategies.DDPStrategy):
    """Lightning's DDPStrategy over the process group that TorchTrainer set up.

    The process group's backend and timeout come from `TorchConfig`, not from this strategy.
    """


class RayFSDPStrategy(_UnbrokenPlacement, pl.strategies.FSDPStrategy):
    """Lightning's FSDPStrategy over the process group that TorchTrainer set up.

    Lightning gathers the full state dict on rank 0 when it saves (its default
    `state_dict_type="full"`), so the checkpoint has the same single file as under DDP.
    """


class RayLightningEnvironment(_environments.LightningEnvironment):
    """Lightning's view of the cluster: ranks and sizes from `train.get_context()`.

    The workers already exist (unbroken started them), so Lightning launches no processes.
    """

    @property
    def creates_processes_externally(self) -> bool:
        return True

    def world_size(self) -> int:
        return train.get_context().get_world_size()

    def global_rank(self) -> int:
        return train.get_context().get_world_rank()

    def local_rank(self) -> int:
        return train.get_context().get_local_rank()

    def node_rank(self) -> int:
        return train.get_context().get_node_rank()

    def set_world_size(self, size: int) -> None:
        """Ignored: the run's context decides the world size."""

    def set_global_rank(self, rank: int) -> None:
        """Ignored: the run's context decides the rank."""

    def teardown(self) -> None:
        """Nothing to undo: the environment variables belong to the worker."""


def prepare_trainer(trainer: Any) -> Any:
    """Check that a Lightning `Trainer` runs on unbroken's workers; returns it unchanged.

    Raises `RuntimeError` when the strategy is not `RayDDPStrategy`/`RayFSDPStrategy` (another
    strategy would start processes of its own or disagree about the ranks) or when the
    cluster environment is not `RayLightningEnvironment`.
    """
    if not isinstance(trainer.strategy, _UnbrokenPlacement):
        raise RuntimeError(f"the Lightning Trainer's strategy is {type(trainer.strategy).__name__}, which "
                           "does not run on unbroken's workers. Hint: pass strategy=RayDDPStrategy() or "
                           "RayFSDPStrategy() from unbroken.train.lightning")
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if environment is not None and not isinstance(environment, RayLightningEnvironment):
        raise RuntimeError(f"the Lightning Trainer's cluster environment is {type(environment).__name__}. "
                           "Hint: pass plugins=[RayLightningEnvironment()] from unbroken.train.lightning")
    return trainer


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    with contextlib.suppress(ImportError):
        import numpy as np

        state["numpy"] = np.random.get_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


class RayTrainReportCallback(pl.callbacks.Callback):
    """Reports `trainer.callback_metrics` (plus `epoch` and `step`) and a checkpoint at the end
    of every training epoch, on every rank (`train.report` is collective).

    The checkpoint is Ray's layout, plus each rank's random generators::

        checkpoint_00000N/
          checkpoint.ckpt     the Lightning checkpoint (trainer.save_checkpoint, from rank 0)
          rng_rank<k>.pt      python/numpy/torch generator states of the run's rank k

    When `trainer.fit(..., ckpt_path=...)` resumes from `checkpoint.ckpt`, this callback puts
    back this rank's generators saved beside it before the fit loop starts, so the run goes on
    drawing the numbers the uninterrupted run drew after that epoch.
    """

    CHECKPOINT_NAME = "checkpoint.ckpt"

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # The latest hook before the fit loop draws from the generators (creating the first
        # epoch's data iterator draws a seed); the sanity check that follows runs with its own
        # generators (Lightning's isolate_rng), so it does not disturb them.
        path = trainer.ckpt_path
        if path and os.path.basename(str(path)) == self.CHECKPOINT_NAME:
            rng = _rng_file(os.path.dirname(str(path)))
            if os.path.exists(rng):
                _set_rng_state(torch.load(rng, weights_only=False))

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        metrics = {name: _number(value) for name, value in trainer.callback_metrics.items()}
        metrics["epoch"] = trainer.current_epoch
        metrics["step"] = trainer.global_step
        with tempfile.TemporaryDirectory(prefix="unbroken-lightning-") as d:
            torch.save(_rng_state(), _rng_file(d))
            path = os.path.join(d, self.CHECKPOINT_NAME)
            trainer.save_checkpoint(path, weights_only=False)
            if trainer.world_size != train.get_context().get_world_size():
                _check_one_model(trainer, path)
            train.report(metrics, checkpoint=Checkpoint.from_directory(d))


def _rng_file(directory: str) -> str:
    """This rank's generator file: named by the run's rank, which Lightning's own rank is only
    under unbroken's strategies (without them every rank's Trainer is rank 0)."""
    return os.path.join(directory, f"rng_rank{train.get_context().get_world_rank()}.pt")


_warned_alone = False


def _check_one_model(trainer: Any, path: str) -> None:
    """The Trainer does not know the run's other ranks (no unbroken strategy), so every rank
    trains alone and writes `checkpoint.ckpt`. Ranks that trained the same model write the same
    file, which the run keeps once; a rank whose file differs from rank 0's raises here, with
    what to change, instead of the checkpoint failing to commit. Collective."""
    global _warned_alone
    context = train.get_context()
    why = (f"the Lightning Trainer sees {trainer.world_size} process(es) but the run has "
           f"{context.get_world_size()}, so each rank trains a model of its own")
    hint = ("Hint: pass strategy=RayDDPStrategy() and plugins=[RayLightningEnvironment()] to the "
            "Trainer and call prepare_trainer(trainer) (unbroken.train.lightning), so the ranks train "
            "one model together")
    if context.get_world_rank() == 0 and not _warned_alone:
        _warned_alone = True
        log.warning("%s. %s", why, hint)
    mine = _digest(path) if os.path.exists(path) else None
    first = collective.broadcast_from_rank_zero(mine)
    if mine is not None and first is not None and mine != first:
        raise CheckpointConflictError(
            f"rank {context.get_world_rank()}'s {RayTrainReportCallback.CHECKPOINT_NAME} differs from "
            f"rank 0's: {why}, and one checkpoint cannot hold them all. {hint}")


def _digest(path: str) -> tuple[int, int]:
    """(size, CRC-32) of a file: what the commit compares when two ranks write the same path."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            crc = zlib.crc32(block, crc)
    return os.path.getsize(path), crc


def _number(value: Any) -> Any:
    """A logged metric as a JSON value: a one-element tensor becomes its Python number."""
    if isinstance(value, torch.Tensor):
        return value.item()
    return value


@contextlib.contextmanager
def checkpoint_path(checkpoint: Checkpoint | None = None) -> Iterator[str | None]:
    """The path of `checkpoint.ckpt` in `checkpoint` (default: `train.get_checkpoint()`, the
    run's latest committed checkpoint) for `trainer.fit(ckpt_path=...)`, or None when there
    is none (a fresh run). On remote storage the files are a local copy while the block runs.
    """
    checkpoint = checkpoint if checkpoint is not None else train.get_checkpoint()
    with checkpoint.as_directory() if checkpoint is not None else contextlib.nullcontext() as d:
        yield None if d is None else os.path.join(d, RayTrainReportCallback.CHECKPOINT_NAME)


def fit_or_resume(trainer: Any, model: Any, **fit_kwargs: Any) -> None:
    """`trainer.fit(model, ckpt_path=<latest checkpoint>, **fit_kwargs)`: starts fresh on a new
    run, and resumes a restored or re-run one from its last committed checkpoint (weights,
    optimizer, schedulers, loop counters, callbacks, random generators)."""
    with checkpoint_path() as path:
        trainer.fit(model, ckpt_path=path, **fit_kwargs)
