"""A Hugging Face stream's pass carried over to another number of ranks (a restore with another
`num_workers`, an elastic resize), each shard continuing at its position.

At W ranks, rank o reads `split_dataset_by_node(dataset, rank=o, world_size=W)`: without a
shuffle buffer, and with no DataLoader workers interleaving its shards, that is a
deterministic stream of which the run had trained on exactly the first `batches × batch_size`
examples when it saved (every rank takes one batch per step). So the rest of the pass is
known without any library state: each old rank's stream after its trained examples, one old
rank after the other. With W' ranks, that rest is cut into global batches of `batch_size × W'`
examples and rank r keeps examples `[r·batch_size, (r+1)·batch_size)` of each, so the ranks
stay in step; a last, short global batch is split evenly and its remainder (fewer examples
than ranks) dropped, as Ray Data's shards do (`worker/ray_data_shard.py`). Each example of the
pass is trained on once, but for that remainder.

A carried pass saved again and resumed (at any size) continues the same rest: `skip` counts
the examples of it already consumed. The next pass is the dataset's own split at the new size.

The cost: every new rank reads the old ranks' trained examples again to pass them (a stream
cannot seek to an example without the library's own, per-rank state), and the rest of the
pass in full, keeping its share (`benchmarks/bench_data.py` measures it).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any


def carried(counts: dict[str, Any], batch_size: int) -> dict[str, int]:
    """Where the rest of a saved pass starts, from its saved counts (`StreamPosition`): the old
    size, the batches each of its ranks trained on, and the examples of the rest consumed since
    (for a pass that had itself been carried)."""
    before = counts.get("carried")
    if before is None:
        return {"world_size": int(counts["world_size"]), "batches": int(counts["batches"]), "skip": 0}
    consumed = int(counts["batches"]) * batch_size * int(counts["world_size"])
    return {**before, "skip": int(before["skip"]) + consumed}


def rest_of_pass(streams: Iterable[Iterable[Any]], carry: dict[str, int], batch_size: int) -> Iterator[Any]:
    """The examples of the pass not yet trained on: each old rank's stream (`streams`, in rank
    order) after its trained examples, then `carry["skip"]` of those dropped."""
    trained = carry["batches"] * batch_size
    rest = itertools.chain.from_iterable(itertools.islice(s, trained, None) for s in streams)
    return itertools.islice(rest, carry["skip"], None)


def shares(examples: Iterable[Any], batch_size: int, rank: int, world_size: int,
           drop_last: bool) -> Iterator[list[Any]]:
    """Rank `rank`'s part of each global batch of `batch_size × world_size` examples; a short
    last one split evenly (nothing of it with `drop_last`)."""
    size = batch_size * world_size
    it = iter(examples)
    while True:
        whole = list(itertools.islice(it, size))
        if len(whole) == size:
            yield whole[rank * batch_size:(rank + 1) * batch_size]
            continue
        share = 0 if drop_last else len(whole) // world_size
        if share:
            yield whole[rank * share:(rank + 1) * share]
        return


def old_rank_streams(dataset: Any, world_size: int) -> Iterator[Iterable[Any]]:
    """Each rank's stream of a Hugging Face IterableDataset at `world_size` ranks, in rank
    order, built from this rank's split of it (made lazily: one is read at a time)."""
    from datasets import IterableDataset
    from datasets.distributed import split_dataset_by_node

    # The unsplit dataset, made as `split_dataset_by_node` makes a split: `copy` would share
    # the dataset's attributes (its pickled state is its own __dict__).
    whole = IterableDataset(ex_iterable=dataset._ex_iterable, info=dataset._info.copy(),
                            split=dataset._split, formatting=dataset._formatting,
                            token_per_repo_id=dataset._token_per_repo_id)
    for rank in range(world_size):
        yield split_dataset_by_node(whole, rank=rank, world_size=world_size)


def hf_split(dataset: Any) -> tuple[int, int] | None:
    """(rank, world size) of a Hugging Face IterableDataset split by node; None otherwise."""
    split = getattr(dataset, "_distributed", None)
    rank, world = getattr(split, "rank", None), getattr(split, "world_size", None)
    return (rank, world) if isinstance(rank, int) and isinstance(world, int) else None


def refusal(saved: dict[str, Any], now: dict[str, Any], split: tuple[int, int] | None,
            world_size: int, shuffle_buffer: bool) -> str | None:
    """Why a saved pass of this stream cannot be carried to `world_size` ranks, or None when it
    can. `saved`/`now`: what identified the data then and now (`StreamLoader._data`)."""
    if split is None:
        return "it is not a Hugging Face IterableDataset split with split_dataset_by_node"
    if shuffle_buffer:
        return "a shuffle buffer's order cannot be replayed for other ranks"
    if split[1] != world_size:
        return (f"the dataset is split for {split[1]} ranks and the run has {world_size}. Hint: "
                "split_dataset_by_node(..., world_size=train.get_context().get_world_size())")
    if saved.get("workers") != 0:
        return ("the run read it with DataLoader workers, which interleave each rank's shards "
                "(or it was saved by an older version)")
    for key in ("total_shards", "batch_size"):
        if saved.get(key) != now.get(key):
            return f"its {key} was {saved.get(key)!r} and is {now.get(key)!r}"
    return None
