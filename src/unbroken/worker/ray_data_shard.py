"""RayDataShard: what `train.get_dataset_shard(name)` returns for a `ray.data.Dataset`, with an
exact position TrainState saves.

Ray Train hands each rank a `streaming_split` of the dataset: rows go to whichever rank asks
first, so no rank's sequence can be replayed, and its `DataIterator` has no position to save
(ray-project/ray#37633, #48224). Here every pass reads the dataset in its deterministic order
(`preserve_order`) in *global batches* of `batch_size × world_size` rows, and rank r keeps rows
`[r·batch_size, (r+1)·batch_size)` of each. So:

- **one position for the run**: when every rank has taken n batches, the run has consumed
  exactly the first rows of the pass up to the n-th global batch. That row count, with the
  pass number, is what `state_dict()` holds, the same on every rank (rank 0 saves it).
- **the same size resumes bit for bit**: the resumed pass skips the rows consumed and cuts
  the same global batches, so each rank continues at the next batch it had not trained on.
- **another size shares out the rest**: a restore or an elastic resize with W' ranks cuts the
  rest of the pass into global batches of `batch_size × W'`: each row once per pass.
- **equal shares**: a last, short global batch is split evenly and its remainder (fewer rows
  than ranks) dropped, as Ray's `streaming_split(equal=True)` does; `drop_last=True` drops it.

The cost, against Ray's split: every rank reads every row of the pass and keeps its share, and
a resume reads the consumed rows again to skip them (Ray Data cannot seek to a row). Both are
measured in `benchmarks/bench_data.py`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from unbroken.errors import StateMismatchError, UnsupportedOptionError

if TYPE_CHECKING:
    import numpy as np

    from unbroken.worker.session import Session

KIND = "ray_data"
# Each attempt's shards by name: get_dataset_shard called again (in every epoch, say) returns the
# same shard, whose position goes on, as Ray's DataIterator does.
_shards: weakref.WeakKeyDictionary[Session, dict[str, RayDataShard]] = weakref.WeakKeyDictionary()


def shard_of(session: Session, name: str, dataset: Any) -> RayDataShard:
    """This attempt's shard of `dataset` for this rank. Ray Data runs on the Ray engine, whose
    workers are in a Ray cluster; a local worker would start a Ray instance of its own."""
    import ray

    if not ray.is_initialized():
        raise UnsupportedOptionError(
            f"datasets={{{name!r}: <ray.data.Dataset>}} is read on the Ray engine, and these workers are "
            "local processes. Hint: run on a Ray cluster (ray.init(address=...) before fit(), or "
            "ScalingConfig(engine='ray')), or pass a torch Dataset or a list")
    shards = _shards.setdefault(session, {})
    if name not in shards:
        shards[name] = RayDataShard(dataset, session.info.world_rank, session.info.world_size)
    return shards[name]


def _rows_in(batch: dict[str, np.ndarray]) -> int:
    return len(next(iter(batch.values()))) if batch else 0


def _cut(batch: dict[str, np.ndarray], start: int, stop: int) -> dict[str, np.ndarray]:
    return {k: v[start:stop] for k, v in batch.items()}


def _join(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if len(parts) == 1:
        return parts[0]
    import numpy as np

    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


class RayDataShard:
    """This rank's share of a Ray Dataset, iterated like Ray Train's `DataIterator`
    (`iter_batches`, `iter_torch_batches`, `iter_rows`: each call one pass, an epoch), with its
    position in `state_dict()` / `load_state_dict()` (hand the shard to `TrainState(loader=...)`)."""

    def __init__(self, dataset: Any, rank: int, world_size: int) -> None:
        self._dataset = dataset
        self.rank = rank
        self.world_size = world_size
        self._passes = 0
        self._rows = 0  # rows of the current pass consumed by the run, all ranks together
        self._done = False
        self._continue = False

    # -- position ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The run's position in the current pass, the same on every rank."""
        return {"kind": KIND, "passes": self._passes, "rows": self._rows, "done": self._done,
                "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved pass at its next row, with this run's number of ranks."""
        if not isinstance(state, dict) or state.get("kind") != KIND:
            raise StateMismatchError(
                "the checkpoint's loader state is not a Ray Data position: the run read another kind of "
                "loader. Hint: resume with the data the run was started with, or start a new run")
        self._passes, self._rows, self._done = int(state["passes"]), int(state["rows"]), bool(state["done"])
        self._continue = self._passes > 0 and not self._done

    def _begin(self) -> int:
        if self._continue:
            self._continue = False
            return self._rows
        self._passes += 1
        self._rows, self._done = 0, False
        return 0

    # -- passes -----------------------------------------------------------------------------

    def _global_batches(self, per_rank: int, drop_last: bool, prefetch_batches: int = 1
                        ) -> Iterator[dict[str, np.ndarray]]:
        """This rank's part of each global batch of the pass, from the current position."""
        if not isinstance(per_rank, int) or per_rank < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {per_rank!r}. Hint: the batch size "
                             "is per rank, as in Ray Train")
        # The dataset runs with the context it was built with (a copy of the driver's), not this
        # process's current one: the order is set there.
        self._dataset.context.execution_options.preserve_order = True
        skip = self._begin()
        size = per_rank * self.world_size
        held: list[dict[str, np.ndarray]] = []
        count = 0
        for batch in self._dataset.iter_batches(batch_size=size, batch_format="numpy",
                                                prefetch_batches=prefetch_batches):
            rows = _rows_in(batch)
            if skip:
                dropped = min(skip, rows)
                skip -= dropped
                batch, rows = _cut(batch, dropped, rows), rows - dropped
            if rows:
                held.append(batch)
                count += rows
            while count >= size:
                whole = _join(held)
                yield self._take(whole, per_rank, size)
                held, count = ([_cut(whole, size, count)] if count > size else []), count - size
        share = 0 if drop_last else count // self.world_size
        if share:
            yield self._take(_join(held), share, count)
        self._done = True

    def _take(self, batch: dict[str, np.ndarray], share: int, consumed: int) -> dict[str, np.ndarray]:
        """This rank's `share` rows of a global batch; the run has then consumed `consumed`."""
        self._rows += consumed
        return _cut(batch, self.rank * share, (self.rank + 1) * share)

    @staticmethod
    def _refuse_local_shuffle(size: Any) -> None:
        if size:
            raise UnsupportedOptionError(
                "local_shuffle_buffer_size: a local shuffle buffer's order depends on where a pass "
                "resumed, so it cannot be resumed exactly. Hint: shuffle the dataset itself with a seed "
                "(ds.random_shuffle(seed=...) or ds.randomize_block_order(seed=...)) before the trainer")

    def iter_batches(self, *, batch_size: int = 256, batch_format: str = "default", drop_last: bool = False,
                     prefetch_batches: int = 1, local_shuffle_buffer_size: int | None = None,
                     local_shuffle_seed: int | None = None) -> Iterator[Any]:
        """One pass over this rank's share, in batches of `batch_size` rows ("numpy"/"default":
        a dict of arrays; "pandas": a DataFrame)."""
        self._refuse_local_shuffle(local_shuffle_buffer_size)
        if batch_format not in ("default", "numpy", "pandas"):
            raise UnsupportedOptionError(f"iter_batches(batch_format={batch_format!r}): this shard yields "
                                         "'numpy' (also 'default') or 'pandas' batches")
        for batch in self._global_batches(batch_size, drop_last, prefetch_batches):
            if batch_format == "pandas":
                import pandas as pd

                yield pd.DataFrame({k: list(v) if v.ndim > 1 else v for k, v in batch.items()})
            else:
                yield batch

    def iter_torch_batches(self, *, batch_size: int = 256, dtypes: Any = None, device: Any = "auto",
                           collate_fn: Any = None, drop_last: bool = False, prefetch_batches: int = 1,
                           local_shuffle_buffer_size: int | None = None,
                           local_shuffle_seed: int | None = None) -> Iterator[Any]:
        """One pass over this rank's share as dicts of tensors (or what `collate_fn` makes of
        each numpy batch), on this worker's device when `device="auto"`."""
        import torch

        from unbroken.worker.torch_backend import get_device

        self._refuse_local_shuffle(local_shuffle_buffer_size)
        target = get_device() if device == "auto" else torch.device(device)
        for batch in self._global_batches(batch_size, drop_last, prefetch_batches):
            if collate_fn is not None:
                yield collate_fn(batch)
                continue
            out = {}
            for key, value in batch.items():
                dtype = dtypes.get(key) if isinstance(dtypes, dict) else dtypes
                if value.dtype == object:  # a column of equal-shaped lists or arrays
                    import numpy as np

                    value = np.stack([np.asarray(v) for v in value])
                out[key] = torch.tensor(value, dtype=dtype, device=target)  # copied: Ray's are read-only
            yield out

    def iter_rows(self) -> Iterator[dict[str, Any]]:
        """One pass over this rank's rows, one at a time (the ranks take turns row by row)."""
        for batch in self._global_batches(1, False):
            yield {k: v[0] for k, v in batch.items()}

    def __repr__(self) -> str:
        return f"RayDataShard(rank={self.rank}, world_size={self.world_size}, {self._dataset!r})"
