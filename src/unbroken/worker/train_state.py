"""TrainState: everything a training loop needs to continue bit for bit after a restart.

    state = TrainState(model=model, optimizer=opt, scheduler=sched, loader=loader, epoch=0)
    state.restore()                      # after building everything, before the first step
    for epoch in range(state.epoch, epochs):
        for batch in loader:
            ...
            state.report({"loss": loss.item()}, checkpoint=step % 100 == 0)
        state.epoch = epoch + 1

A checkpoint written by `report` (or `save`) holds, in one directory:

- `train_state.pt`, written by rank 0 only: the state_dict of the model (unwrapped from DDP
  and torch.compile), optimizer, scheduler, loader (the data position) and every extra object
  with a state_dict, plus the plain extra values. Under DDP these are the same on every rank.
- `rng_rank<r>.pt`, one per rank: that rank's generator states (python `random`, numpy's
  global RNG, torch CPU, the current CUDA device's) and any torch.Generator extras.
- `loader_rank<r>.pt`, one per rank, for a streaming loader whose position is its rank's own
  (torchdata's StatefulDataLoader, a stateful IterableDataset: `unbroken.state.stream_loader`):
  that rank's library state, to seek with; the counts every rank shares are in
  `train_state.pt`.

Both load with `torch.load(..., weights_only=True)`: RNG states are stored as tensors, ints
and tuples, never as pickled objects.

A sharded model (FSDP2, tensor parallelism: its parameters are DTensors) and its optimizer are
saved through torch.distributed.checkpoint instead (`unbroken.state.sharded`): every rank writes its
shards into `dcp-a<attempt>/`, and `train_state.pt` holds the rest and names that directory.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Callable, Collection, Iterable
from typing import Any, Literal

import torch

from unbroken.state.state_file import (
    LOADABLE_SCALARS,
    build_payload,
    capture_rng,
    plain_problem,
    snapshot,
    unwrap,
    write_files,
)
from unbroken.state.stream_loader import StreamLoader, kind_of, refusal
from unbroken.store.checkpoint import Checkpoint
from unbroken.worker import session as session_mod
from unbroken.worker import sharded_objects, state_load
from unbroken.worker.recovery import in_loop
from unbroken.worker.recovery import just_in_time as jit_mod
from unbroken.worker.report_config import CheckpointUploadMode, upload_is_async
from unbroken.worker.torch_backend import worker_ranks

COMPONENTS = ("model", "optimizer", "scheduler", "loader")


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class TrainState:
    """The model, optimizer, scheduler, data loader and anything else a loop needs to resume.

    `model`, `optimizer`, `scheduler`, `loader`: optional; each needs `state_dict()` and
    `load_state_dict()`. The loader is the one `prepare_data_loader` returns, a shard of a
    Ray Dataset from `train.get_dataset_shard`, or a streaming loader of your own, unchanged
    (a torchdata `StatefulDataLoader`, a DataLoader over an IterableDataset with
    `state_dict()`), whose position is then each rank's own (`unbroken.state.stream_loader`).
    `**extra`: anything else, by name:

    - plain values (None, bool, int, float, str, tensors, and lists, tuples and dicts of them):
      epoch counters, a best score, running sums. Read and assign them as attributes
      (`state.epoch`, `state.epoch = 3`); `restore()` sets them to the saved values.
    - objects with `state_dict()`/`load_state_dict()` (a GradScaler, an EMA model, a second
      optimizer): saved from rank 0 and loaded on every rank, like the model.
    - torch.Generator objects: saved and restored per rank, like the global generators.

    Everything is saved from rank 0 except the random generator states, which are per rank;
    that is right for data-parallel training (DDP), where model, optimizer and scheduler are
    identical on every rank. A sharded model (DTensor parameters: FSDP2, tensor parallelism)
    and its optimizer are the exception: every rank saves its shards through
    torch.distributed.checkpoint, and they restore onto any number of ranks.

    `checkpoint_upload_mode`: how each checkpointing report saves (Ray's `CheckpointUploadMode`,
    as `train.report` takes it; a report may name its own): SYNC writes the files before
    `report` returns; ASYNC copies the state into memory and writes it in the background
    (`unbroken.worker.async_save`). `async_save=True` is its older, deprecated spelling.

    `step_seed`: per-step random streams: after every report (and in `restore()`) each rank's
    generators are re-seeded from (step_seed, rank, report), so what a step draws does not
    depend on any rank's earlier state. `jit_checkpoint`: track the state so that, when a rank
    fails, a surviving rank saves the state of the last report as a checkpoint
    (`unbroken.worker.recovery.just_in_time`); by default (None) as the run's `FailureConfig.recovery` says
    ("just_in_time" or "in_place"). It needs per-step streams, seeded from `step_seed` when
    given, else from each rank's own seed (`jit.step_seed_of`: its torch seed as the loop
    left it, recorded by the run for its later attempts).
    """

    def __init__(self, model: Any = None, optimizer: Any = None, scheduler: Any = None,
                 loader: Any = None, *, checkpoint_upload_mode: CheckpointUploadMode | str = "SYNC",
                 jit_checkpoint: bool | None = None, step_seed: int | None = None,
                 async_save: bool | None = None, **extra: Any) -> None:
        if async_save is not None:
            if not isinstance(async_save, bool):
                raise TypeError(f"TrainState(async_save=...) takes a bool, got {type(async_save).__name__}. "
                                "Hint: checkpoint_upload_mode=CheckpointUploadMode.ASYNC")
            warnings.warn("TrainState(async_save=...) is the older spelling of "
                          "TrainState(checkpoint_upload_mode=CheckpointUploadMode.ASYNC), as train.report "
                          "takes it", DeprecationWarning, stacklevel=2)
            checkpoint_upload_mode = "ASYNC" if async_save else "SYNC"
        object.__setattr__(self, "_async_save", upload_is_async(checkpoint_upload_mode, "TrainState"))
        object.__setattr__(self, "_objects", {})
        object.__setattr__(self, "_values", {})
        object.__setattr__(self, "_generators", {})
        for name, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler),
                          ("loader", loader)):
            if obj is not None:
                self._objects[name] = self._check_stateful(name, obj)
        reserved = set(dir(type(self))) | set(COMPONENTS) | {"async_save", "checkpoint_upload_mode"}
        for name, value in extra.items():
            if name in reserved or name.startswith("_"):
                raise ValueError(f"TrainState(..., {name}=...): {name!r} is a reserved name. Hint: "
                                 "give that value another name")
            if isinstance(value, torch.Generator):
                self._generators[name] = value
            elif kind_of(value) is not None or refusal(value, name) is not None:
                self._objects[name] = self._check_stateful(name, value)
            elif _is_stateful(value) and not isinstance(value, torch.Tensor):
                self._objects[name] = value
            else:
                self._check_plain(name, value)
                self._values[name] = value
        jit = jit_mod.armed(jit_checkpoint)
        object.__setattr__(self, "_step_seed", jit_mod.step_seed_of(step_seed, jit))
        if jit:
            jit_mod.arm(self, self._step_seed)

    @staticmethod
    def _check_stateful(name: str, obj: Any) -> Any:
        """`obj`, or, for a stream loader (its position per rank), its `StreamLoader`."""
        refused = refusal(obj, name)
        if refused:
            raise TypeError(refused)
        if kind_of(obj) is not None:
            return StreamLoader.of(obj, worker_ranks()[1])
        if not _is_stateful(obj):
            hint = ""
            if name == "loader":
                why = getattr(obj, "why_not_resumable", None)
                hint = (f"prepare_data_loader could not make this loader resumable: {why}"
                        if why else "pass the loader that prepare_data_loader(DataLoader(...)) returns")
            raise TypeError(f"TrainState({name}=...) needs an object with state_dict() and "
                            f"load_state_dict(), got {type(obj).__name__}. Hint: "
                            f"{hint or 'pass it as a plain value or drop it'}")
        return obj

    @staticmethod
    def _check_plain(name: str, value: Any) -> None:
        problem = plain_problem(value, name)
        if problem:
            raise TypeError(
                f"TrainState cannot save {name!r}: {problem}, which is neither a plain value (None, "
                "bool, int, float, str, tensor, or a list/tuple/dict of those) nor an object with "
                "state_dict() and load_state_dict(). Hint: store a plain value instead (e.g. "
                "float(x), int(x), x.tolist()), or give the object state_dict/load_state_dict")

    # -- attribute access to the extras ---------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # internals not set yet (e.g. while unpickling)
            raise AttributeError(name)
        for table in ("_objects", "_values", "_generators"):
            entries = self.__dict__.get(table, {})
            if name in entries:
                entry = entries[name]
                return entry.loader if isinstance(entry, StreamLoader) else entry
        raise AttributeError(f"TrainState has no {name!r}; it holds {self.names()}. Hint: declare "
                             f"it when building the state: TrainState(..., {name}=initial_value)")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._values:
            self._check_plain(name, value)
            self._values[name] = value
        elif name in self._objects:
            self._objects[name] = self._check_stateful(name, value)
        elif name in self._generators:
            if not isinstance(value, torch.Generator):
                raise TypeError(f"TrainState.{name} holds a torch.Generator; got {type(value).__name__}")
            self._generators[name] = value
        else:
            raise AttributeError(f"TrainState has no {name!r} to set; it holds {self.names()}. Hint: "
                                 f"declare it when building the state: TrainState(..., {name}=initial_value)")

    def names(self) -> list[str]:
        """Everything this state saves, by name."""
        return [*self._objects, *self._values, *self._generators]

    def __repr__(self) -> str:
        return f"TrainState({', '.join(self.names())})"

    # -- saving ---------------------------------------------------------------------------

    def state_dicts(self, exclude: Collection[str] = ()) -> dict[str, Any]:
        """The state_dict of every object this state holds (the model unwrapped), by name,
        but those in `exclude`.

        For a sharded model these hold this rank's shards (DTensors); `save` writes those
        through torch.distributed.checkpoint instead."""
        return {name: unwrap(obj).state_dict() if name == "model" else obj.state_dict()
                for name, obj in self._objects.items() if name not in exclude}

    def sharded_names(self) -> list[str]:
        """The objects saved through torch.distributed.checkpoint, one shard per rank: the
        model when its parameters are sharded (FSDP2, tensor parallelism), and its optimizer
        once it holds state (`sharded_objects`)."""
        return sharded_objects.sharded_names(self._objects)

    def save(self, directory: str | os.PathLike) -> list[str]:
        """Write this rank's files of a checkpoint into `directory`; returns their names.

        Rank 0 writes `train_state.pt` (objects and plain values); every rank writes
        `rng_rank<r>.pt`. A sharded model and its optimizer go through
        torch.distributed.checkpoint: every rank writes its shards into a subdirectory
        (collective). `report(..., checkpoint=True)` calls this; call it yourself to attach
        TrainState's files to a checkpoint of your own.
        """
        return self._write(os.fspath(directory))

    def _write(self, directory: str, shards_in: str | None = None) -> list[str]:
        """`save`; with `shards_in` (a directory), the shards are written there and `directory`
        gets links to them, which the report stages without copying them again."""
        written = []
        sharded = self.sharded_names()
        shards = None
        if sharded:
            from unbroken.state import sharded as sharded_mod

            shards = sharded_objects.shard_dir()
            live = sharded_objects.live_shards(self._objects, sharded)
            written += sharded_mod.save_into(directory, shards, live, shards_in)
        return written + write_files(directory, worker_ranks()[0], *self._capture(sharded, shards))

    def _capture(self, sharded: list[str], shards: str | None, copy: bool = False
                 ) -> tuple[dict[str, Any] | None, dict[str, Any], dict[str, Any]]:
        """(rank 0's `train_state.pt` payload, or None on the other ranks; this rank's RNG file;
        this rank's stream loader states), checked for what torch.load(weights_only=True) loads
        back. With `copy`, every tensor is copied (to CPU memory), so that training may go on
        while they are written."""
        rank, world_size = worker_ranks()
        payload = None
        if rank == 0:
            for name, value in self._values.items():
                self._check_plain(name, value)
            state_dicts = self.state_dicts(exclude=sharded)
            for name, sd in state_dicts.items():
                problem = plain_problem(sd, f"{name}.state_dict()", LOADABLE_SCALARS)
                if problem:
                    raise TypeError(f"TrainState cannot save {name!r}: {problem}, which "
                                    "torch.load(weights_only=True) cannot load back. Hint: make its "
                                    "state_dict() return tensors and plain values only; only the model "
                                    "and its optimizer are saved sharded")
            payload = build_payload(state_dicts, dict(self._values), world_size,
                                    {"directory": shards, "names": sharded} if sharded else None)
        rng = capture_rng(self._generators)
        loaders = {name: seek for name, obj in self._objects.items()
                   if isinstance(obj, StreamLoader) and (seek := obj.seek_state()) is not None}
        return (snapshot(payload), rng, snapshot(loaders)) if copy else (payload, rng, loaders)

    def for_each_batch(self, loader: Iterable[Any], step: Callable[[Any], Any]) -> None:
        """Call `step(batch)` for each batch of `loader`'s current pass (one epoch, or what is
        left of it after a resume). Use it for the loop, with `step` reporting at its end, to
        recover in place without leaving it: when a rank fails, the others keep everything
        the training function built (model, optimizer, loader, persistent loader workers) and
        redo the step from the state of the last report, bit for bit
        (`FailureConfig(recovery="in_place")`, `loader` this state's own). The code before
        the loop runs again only in a replacement rank, so it must make no collectives of its
        own (`prepare_model`'s are taken care of). Otherwise it is a plain loop
        (docs/exact-resume.md, "Recovering in place")."""
        in_loop.for_each_batch(self, loader, step)

    def report(self, metrics: dict[str, Any], checkpoint: bool | Literal["auto"] = False,
               checkpoint_upload_mode: CheckpointUploadMode | str | None = None) -> bool:
        """`train.report(metrics)`, with this state saved as the checkpoint when `checkpoint`
        is true or when the driver asks for one (a preemption: should_checkpoint()).
        `checkpoint="auto"`: when the driver asks, which it does at the interval that wastes
        least for what a save costs and how often the run fails (Young/Daly; see
        docs/guarantees.md#how-often-to-checkpoint). `checkpoint_upload_mode`: this report's,
        as train.report takes it (default: the state's); ASYNC copies the state into memory
        and writes it in the background.

        Collective, like train.report: every rank calls it with the same `checkpoint`.
        Returns whether a checkpoint was attached.
        """
        if not isinstance(checkpoint, bool) and checkpoint != "auto":
            raise TypeError(f"TrainState.report(checkpoint=...) takes a bool or \"auto\", got "
                            f"{checkpoint!r}. Hint: to report a checkpoint of your own, "
                            "call train.report(metrics, checkpoint=Checkpoint.from_directory(d))")
        session = session_mod.current("TrainState.report()")
        session.auto_checkpoints(checkpoint == "auto")
        checkpoint = checkpoint is True
        # Asked before this report, so every rank gets the driver's answer for the same report.
        if not (checkpoint or session.should_checkpoint()):
            session.report(metrics)
            return False
        session.saving()
        if (self._async_save if checkpoint_upload_mode is None
                else upload_is_async(checkpoint_upload_mode, "TrainState.report")):
            session.wait_for_save()  # one save in flight: the previous copy is freed before this one
            session.report_async(metrics, self._snapshot_writer())
            return True
        with tempfile.TemporaryDirectory(prefix="unbroken-state-") as d:
            self._write(d, sharded_objects.next_staging() if self.sharded_names() else None)
            session.report(metrics, Checkpoint.from_directory(d))
        return True

    def _snapshot_writer(self) -> Callable[[], tuple[str, bool]]:
        """Copy this rank's part of a checkpoint into memory now; returns the function that
        writes it into a new temporary directory later (in the background: ASYNC)."""
        sharded = self.sharded_names()
        shards, shard_state, group, staging = None, None, None, None
        if sharded:
            from unbroken.state import sharded as sharded_mod

            shards = sharded_objects.shard_dir()
            shard_state = snapshot(sharded_objects.live_shards(self._objects, sharded))
            group = sharded_mod.background_group()
            staging = sharded_objects.next_staging()
        payload, rng, loaders = self._capture(sharded, shards, copy=True)

        def write() -> tuple[str, bool]:
            directory = tempfile.mkdtemp(prefix="unbroken-state-")
            if shard_state is not None:
                sharded_mod.save_into(directory, shards, shard_state, staging, group)
            write_files(directory, worker_ranks()[0], payload, rng, loaders)
            return directory, True
        return write

    # -- restoring ------------------------------------------------------------------------

    def restore(self, checkpoint: Checkpoint | None = None, *, strict: bool = True) -> bool:
        """Load the latest committed checkpoint (`train.get_checkpoint()`), or `checkpoint`,
        into every object, the plain values and this rank's generators. Returns False, and
        changes nothing, when there is none (a fresh run); with `step_seed`, the generators are
        then seeded for the first steps all the same.

        Call it after building the model, optimizer, scheduler and loader and before the first
        training step: the generators are set last, so randomness drawn while building the
        objects does not shift the resumed random stream. `strict=False` loads what the
        checkpoint and this state have in common and logs the rest.
        """
        if checkpoint is None:
            session = session_mod.current("TrainState.restore()")
            if session.peer_state is not None:  # recovering in place: a peer sent the state
                state_load.apply(self._objects, self._values, session.peer_state,
                                 "the state a surviving rank sent", strict)
                session.peer_state_loaded()
                self._start_step_streams()
                return True
            checkpoint = session.get_checkpoint()
        if checkpoint is None:
            self._start_step_streams()
            return False
        with checkpoint.as_directory() as d:
            self.load(d, strict=strict)
        self._start_step_streams()
        return True

    def _start_step_streams(self) -> None:
        """With `step_seed`, inside a run: seed this rank's generators for the steps after the
        run's current report (the one resumed from, or 0), as each report does for the next."""
        session = session_mod.active()
        if self._step_seed is not None and session is not None:
            jit_mod.seed_step(self._step_seed, session.info.world_rank, session.iteration, self._generators)

    def load(self, directory: str | os.PathLike, *, strict: bool = True) -> None:
        """Load a checkpoint directory written by `save`/`report` into this state."""
        state_load.load(self._objects, self._values, self._generators, os.fspath(directory), strict)
