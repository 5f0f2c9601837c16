"""A rank's part of a dataset, as `train.get_dataset_shard` returns it (`shard`), marked with
the dataset it was cut from.

Whatever shares out its dataset among the ranks itself (`prepare_data_loader`, Lightning's
distributed sampler under `RayDDPStrategy`, the Transformers Trainer through accelerate) would
split a shard a second time, and each rank would train on 1/world² of the data. Those
integrations ask `whole_of(dataset)` and share out the whole dataset instead, with their own
seeded order and padding, exactly as if they had been given it: together the ranks see each
sample once an epoch.

The mark is an instance attribute (list and tuple shards become `ListShard` / `TupleShard`, which
can carry one); a dataset that wraps a shard is not a shard. A shard pickles without its mark, so
a DataLoader worker started by spawn gets only the rows.
"""

from __future__ import annotations

from typing import Any

from unbroken.core.codec import is_dataset_builder

_MARK = "_unbroken_whole_dataset"


class ListShard(list):
    """The shard of a list dataset (a list)."""

    def __reduce__(self) -> Any:
        return list, (list(self),)


class TupleShard(tuple):
    """The shard of a tuple dataset (a tuple)."""

    def __reduce__(self) -> Any:
        return tuple, (tuple(self),)


def mark(shard: Any, whole: Any) -> Any:
    """`shard`, marked as cut from `whole` (a dataset that takes no attribute stays unmarked)."""
    if type(shard) is list:
        shard = ListShard(shard)
    elif type(shard) is tuple:
        shard = TupleShard(shard)
    try:
        setattr(shard, _MARK, whole)
    except (AttributeError, TypeError):
        pass
    return shard


def whole_of(dataset: Any) -> Any | None:
    """The dataset `dataset` was cut from when it is a shard `train.get_dataset_shard` returned,
    else None."""
    try:
        return vars(dataset).get(_MARK)
    except TypeError:  # no instance attributes
        return None


def shard(dataset: Any, rank: int, world_size: int) -> Any:
    """This rank's part of a dataset: every world_size-th item starting at rank."""
    if is_dataset_builder(dataset):
        dataset = dataset()
    indices = range(rank, len(dataset), world_size)
    if isinstance(dataset, (list, tuple)):
        return type(dataset)(dataset[i] for i in indices)
    try:
        from torch.utils.data import Dataset, Subset
    except ImportError:  # pragma: no cover - torch is optional for DataParallelTrainer
        return [dataset[i] for i in indices]
    if isinstance(dataset, Dataset) or hasattr(dataset, "__getitem__"):
        return Subset(dataset, list(indices))
    return [dataset[i] for i in indices]
