"""StreamLoader: exact resume for the user's own streaming loader, each rank at its own position.

It takes, unchanged, what map-style resume (`ResumableDataLoader`) cannot: a
`torchdata.stateful_dataloader.StatefulDataLoader` (over a map-style dataset with a
`DistributedSampler`, or over an iterable one), and a `DataLoader` over an `IterableDataset`
with `state_dict()`/`load_state_dict()` (a Hugging Face `datasets.IterableDataset`, streamed
or not, split per rank with `split_dataset_by_node`; or one of your own).

Why it is exact:

- **Counted by what the loop received.** The loader's class is swapped for a subclass (same
  object, same attributes, so the user's `for batch in loader` is unchanged) whose passes
  go through `StreamLoader.iterate`, which counts each batch handed to the loop
  (`StreamPosition`). The counts are the same on every rank, so rank 0 saves them with the
  rest of the state, and a just-in-time checkpoint or a recovery in place knows them for a
  rank that died.
- **Seek where the library is exact, replay where it is not.** Each rank also saves its
  library's own state (the loader's, or the dataset's with `num_workers=0`), tagged with the
  counts it belongs to (`seek_state`). A resume from that rank's own file loads it and seeks.
  Where a library's state is known not to be exact (`replay_reason`: a Hugging Face shuffle
  buffer loses its samples; `datasets` cannot load its state inside DataLoader workers; a
  plain DataLoader's workers hold the dataset's position out of reach), or where no file of
  this rank's is at hand (a just-in-time checkpoint, a recovery in place), the resumed pass
  is replayed from its beginning and the batches already trained on are dropped. That reads
  them again, which `bench_data.py` measures; it needs the pass to be deterministic (a
  seeded shuffle, `set_epoch` called as before).
- **The training generators do not move.** Starting a pass draws DataLoader's base seed, and
  a sampler built without a generator draws from the global one: both are kept out of the
  training random stream (a generator of its own per pass, and the global state put back),
  and nothing a replay fetches in this process moves it either.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from unbroken.errors import StateMismatchError
from unbroken.state import stream_carry
from unbroken.state.loader_workers import die_with_rank
from unbroken.state.sample_seed import sample_seed
from unbroken.state.state_file import LOADABLE_SCALARS, capture_rng, plain_problem, restore_rng
from unbroken.state.stream_position import StreamPosition

logger = logging.getLogger("unbroken")

_ATTR = "_unbroken_stream"


def _is_hf(dataset: Any) -> bool:
    return type(dataset).__module__.split(".")[0] == "datasets"


def _hf_shuffle_buffer(dataset: Any) -> bool:
    """True when a Hugging Face IterableDataset shuffles through a buffer (or when its
    pipeline cannot be walked, to be safe)."""
    todo = [getattr(dataset, "_ex_iterable", None)]
    if todo[0] is None:
        return True
    while todo:
        node = todo.pop()
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            return True
        todo += [n for n in [getattr(node, "ex_iterable", None), *getattr(node, "ex_iterables", [])]
                 if n is not None]
    return False


def _has_state(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _loader_has_state(loader: DataLoader) -> bool:
    """True for a DataLoader subclass with a state of its own (torchdata's StatefulDataLoader)."""
    return _has_state(loader) and type(loader).state_dict is not getattr(DataLoader, "state_dict", None)


def kind_of(loader: Any) -> str | None:
    """How a loader's position is kept: "loader" (its own state_dict, per rank), "dataset" (its
    IterableDataset's), or None when it is not a stream loader (map-style resume, or refused:
    see `refusal`)."""
    if isinstance(getattr(loader, _ATTR, None), StreamLoader):
        return getattr(loader, _ATTR).kind
    if not isinstance(loader, DataLoader):
        return None
    if _loader_has_state(loader):
        return "loader"
    if isinstance(loader.dataset, IterableDataset) and _has_state(loader.dataset):
        return "dataset"
    return None


def refusal(loader: Any, name: str = "loader") -> str | None:
    """Why a DataLoader over an IterableDataset cannot be resumed exactly, with the fix; None
    when it can, or when it is not one."""
    if not isinstance(loader, DataLoader) or kind_of(loader) is not None:
        return None
    if isinstance(loader.dataset, IterableDataset):
        return (f"TrainState({name}=...) got a DataLoader over {type(loader.dataset).__name__}, an "
                "IterableDataset without state_dict()/load_state_dict(), so its position cannot be "
                "saved. Hint: read it through torchdata.stateful_dataloader.StatefulDataLoader, or give "
                "the dataset state_dict() and load_state_dict() (a Hugging Face datasets.IterableDataset "
                "has them)")
    return None


def replay_reason(loader: DataLoader, kind: str) -> str | None:
    """Why this loader's own state cannot be trusted to seek exactly (the resume replays the
    pass instead), or None when it can."""
    dataset = loader.dataset
    iterable = isinstance(dataset, IterableDataset)
    if iterable and _is_hf(dataset):
        if _hf_shuffle_buffer(dataset):
            return "datasets loses a shuffle buffer's samples when it loads its state"
        if loader.num_workers > 0:
            return "datasets cannot load its state inside DataLoader workers"
    if kind == "dataset" and loader.num_workers > 0:
        return "the dataset's position lives in the DataLoader workers, out of the training process's reach"
    return None


def storable(state: Any) -> tuple[Any, str | None]:
    """(`state` as data torch.load(weights_only=True) loads: numpy scalars and arrays become
    Python numbers and tensors; None and why, when something in it cannot be)."""
    converted = _to_data(state)
    problem = plain_problem(converted, "the state", LOADABLE_SCALARS)
    return (None, problem) if problem else (converted, None)


def _to_data(value: Any) -> Any:
    if type(value) in (dict, list, tuple):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        out = {k: _to_data(v) for k, v in items}
        return out if isinstance(value, dict) else type(value)(out.values())
    if type(value).__module__ == "numpy":
        if hasattr(value, "shape") and value.shape != ():
            return torch.from_numpy(value.copy())
        return value.item()
    return value


_classes: dict[type, type] = {}


def _positioned_class(cls: type) -> type:
    """`cls` with its passes going through the loader's StreamLoader (a subclass with no
    fields of its own, so that an instance's class can be swapped for it)."""
    if getattr(cls, "_unbroken_positioned", False):
        return cls
    if cls not in _classes:
        def __iter__(self: Any) -> Iterator[Any]:
            return getattr(self, _ATTR).iterate(functools.partial(cls.__iter__, self))

        _classes[cls] = type(cls.__name__, (cls,), {
            "__iter__": __iter__, "__slots__": (), "_unbroken_positioned": True,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return _classes[cls]


def seek_from(path: str, streams: dict[str, StreamLoader]) -> None:
    """Give each stream loader this rank's saved library state from `path` (its
    `loader_rank<r>.pt`), to seek with instead of replaying; a checkpoint without one (a
    just-in-time save) leaves them replaying."""
    if not streams or not os.path.exists(path):
        return
    saved = torch.load(path, weights_only=True, map_location="cpu")
    for name, stream in streams.items():
        stream.use_seek(saved.get(name))


class StreamLoader:
    """The position of one rank's stream loader, for TrainState: `state_dict()` holds the
    counts (the same on every rank), `seek_state()` this rank's library state."""

    def __init__(self, loader: DataLoader, world_size: int) -> None:
        self.loader = loader
        self.kind = kind_of(loader)
        if self.kind is None:
            raise TypeError(f"{type(loader).__name__} is not a stream loader")
        self.replay_reason = replay_reason(loader, self.kind)
        self.position = StreamPosition(world_size)
        self.move: Callable[[Any], Any] | None = None  # to the device (prepare_data_loader sets it)
        self._seek: Any = None
        self._fresh: Any = None  # a seeked library's state at a pass's start (see `_start`)
        self._unstorable_logged = False
        self._generator = None
        if loader.generator is None:  # passes seeded from their number, not the training stream
            self._generator = loader.generator = torch.Generator()
            if getattr(loader.sampler, "generator", False) is None:
                loader.sampler.generator = self._generator
        loader.worker_init_fn = die_with_rank(loader)
        loader.__class__ = _positioned_class(type(loader))
        setattr(loader, _ATTR, self)

    @classmethod
    def of(cls, loader: DataLoader, world_size: int) -> StreamLoader:
        """The loader's StreamLoader, made on first use."""
        existing = getattr(loader, _ATTR, None)
        if isinstance(existing, StreamLoader):
            existing.position.world_size = world_size
            return existing
        return cls(loader, world_size)

    def _library(self) -> Any:
        return self.loader if self.kind == "loader" else self.loader.dataset

    # -- TrainState's side ---------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The counts of this rank's position (the same on every rank), and what the data was."""
        return {**self.position.state_dict(), "data": dict(self._data)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from saved counts, by replay unless `use_seek` is given this rank's state.
        Refused, with nothing changed, when the data is not what the counts were taken over."""
        name = f"the loader ({type(self.loader).__name__} over {type(self.loader.dataset).__name__})"
        saved, now = state.get("data", {}) if isinstance(state, dict) else {}, self._data
        resized = isinstance(state, dict) and state.get("world_size") != self.position.world_size
        # At another size a rank's share and its loader's settings may differ; the data may not.
        compared = ("dataset", "total_shards", "length") if resized else saved
        changed = [f"{key} was {saved[key]!r}, is {now.get(key)!r}"
                   for key in compared if key in saved and saved[key] != now.get(key)]
        if changed:
            raise StateMismatchError(
                f"{name} reads other data than the run it resumes: {'; '.join(changed)}. Its saved "
                "position does not point into this data. Hint: resume with the data the run was "
                "started with, or start a new run")
        why_not = carry = None
        if resized:
            dataset = self.loader.dataset
            why_not = stream_carry.refusal(
                saved, now, stream_carry.hf_split(dataset) if _is_hf(dataset) else None,
                self.position.world_size, _is_hf(dataset) and _hf_shuffle_buffer(dataset))
            if why_not is None:
                carry = stream_carry.carried(state, self.loader.batch_size or 1)
        self.position.load_state_dict(state, name, carry, why_not)
        self._seek = None

    @functools.cached_property
    def _data(self) -> dict[str, Any]:
        """What identifies the data the position counts through: the dataset's kind, and its
        number of shards (Hugging Face) or of samples (map-style). Once: a just-in-time
        checkpoint copies the state at every report."""
        dataset = self.loader.dataset
        out: dict[str, Any] = {"dataset": type(dataset).__name__}
        shards = getattr(dataset, "num_shards", None) if _is_hf(dataset) else None
        if isinstance(shards, int):
            out["num_shards"] = shards
            total = getattr(getattr(dataset, "_ex_iterable", None), "num_shards", None)
            out["total_shards"] = total if isinstance(total, int) else None
        if not isinstance(dataset, IterableDataset) and hasattr(dataset, "__len__"):
            out["length"] = len(dataset)
        if isinstance(dataset, IterableDataset):  # a replay or a carry counts in these
            out["batch_size"], out["workers"] = self.loader.batch_size, self.loader.num_workers
        return out

    def seek_state(self) -> dict[str, Any] | None:
        """This rank's library state at the current position, tagged with the counts; None
        when it is not exact or not storable as data (the resume then replays)."""
        if self.replay_reason is not None or self.position.carried is not None:
            return None
        library, problem = storable(self._library().state_dict())
        if problem:
            if not self._unstorable_logged:
                self._unstorable_logged = True
                logger.warning("the state of %s is not plain data (%s); it is not saved, and a resume "
                               "replays the pass instead", type(self._library()).__name__, problem)
            return None
        return {"counts": self.position.state_dict(), "library": library}

    def use_seek(self, saved: dict[str, Any] | None) -> None:
        """After `load_state_dict`: seek with this rank's saved library state when it belongs to
        the loaded counts."""
        if saved is None or self.replay_reason is not None or not self.position.continuing:
            return
        if saved.get("counts") == self.position.state_dict():
            self._seek = saved["library"]

    # -- the loader's side ---------------------------------------------------------------

    def _seek_to(self, seek: Any, start: Callable[[], Iterator[Any]]) -> Iterator[Any]:
        """Load this rank's saved library state and begin the pass there; a library that refuses
        its own state is named, with the cause."""
        library = self._library()
        try:
            if _is_hf(library) and self._fresh is None:
                self._fresh = library.state_dict()
            library.load_state_dict(seek)
            return start()
        except Exception as e:
            raise StateMismatchError(
                f"{type(library).__name__}.load_state_dict() refused this rank's saved position: "
                f"{type(e).__name__}: {e}. The data it reads may have changed since the checkpoint "
                "(other files, another number of shards or workers). Hint: resume with the data and "
                "loader settings the run was started with; the checkpoint is unchanged") from e

    def _start(self, start: Callable[[], Iterator[Any]]) -> Iterator[Any]:
        """A pass from its beginning. A Hugging Face dataset begins every pass of the epoch it
        was given a state in at that state (until `set_epoch` moves on): after a seek, it is
        given its start again, so that a later pass, or a replay, reads the whole pass."""
        if self._fresh is not None:
            self._library().load_state_dict(self._fresh)
        return start()

    def _carried_pass(self, carry: dict[str, int]) -> Iterator[Any]:
        """The rest of a pass another number of ranks began (`stream_carry`), as this rank's
        batches."""
        dataset, size = self.loader.dataset, self.loader.batch_size
        rank, world = stream_carry.hf_split(dataset)  # type: ignore[misc]  # checked at the carry
        rest = stream_carry.rest_of_pass(stream_carry.old_rank_streams(dataset, carry["world_size"]),
                                         carry, size or 1)
        for part in stream_carry.shares(rest, size or 1, rank, world, self.loader.drop_last):
            yield self.loader.collate_fn(part if size is not None else part[0])

    def iterate(self, start: Callable[[], Iterator[Any]]) -> Iterator[Any]:
        """One pass: continue a loaded position (seek or replay), count what the loop takes."""
        skip = self.position.begin()
        if self._generator is not None:  # seeded first: a seek may set the sampler's state after
            self._generator.manual_seed(sample_seed(0x5EED, self.position.passes, 0))
        seek, self._seek = self._seek, None
        held = capture_rng()
        try:
            if self.position.carried is not None:
                batches = self._carried_pass(self.position.carried)
            elif skip and seek is not None:
                batches = self._seek_to(seek, start)
                skip = 0
            else:
                batches = self._start(start)
            skipped = sum(1 for _ in itertools.islice(batches, skip))
        finally:
            restore_rng(held)
        if skipped < skip:  # the pass had been trained on to its last batch
            self.position.end()
            return
        for batch in batches:
            self.position.took()
            yield batch if self.move is None else self.move(batch)
        self.position.end()
