"""Worker payloads that may hold Ray Datasets: cloudpickle, with each `ray.data.Dataset` sent
through Ray's object store instead of inside the bytes.

A Ray Dataset holds object references of its own (a file-based one `ray.put`s its list of
paths). Inside plain pickled bytes such a reference loses its owner, and the rank that reads
the dataset waits for it forever. So `dumps` leaves a token where each dataset was and returns
the datasets apart; the Ray engine `ray.put`s them and hands the references to the rank actor
as arguments of their own (Ray then tracks them), and `loads` puts each dataset back, after the
actor has set up its import path. A rank that stays for the next attempt (a recovery in place)
gets that attempt over its pipe, with the same tokens: it finds the datasets it was given.
"""

from __future__ import annotations

import io
import pickle
import sys
from typing import Any

import cloudpickle

_TAG = "unbroken-ray-dataset"
_received: dict[str, Any] = {}  # this process's datasets, by token


def is_ray_dataset(obj: Any) -> bool:
    """True for a `ray.data.Dataset` (without importing ray: none exists until it is imported)."""
    data = sys.modules.get("ray.data")
    return data is not None and isinstance(obj, data.Dataset)


class _Pickler(cloudpickle.CloudPickler):
    def __init__(self, file: io.BytesIO, apart: dict[str, Any]) -> None:
        super().__init__(file)
        self.apart = apart

    def persistent_id(self, obj: Any) -> Any:
        if not is_ray_dataset(obj):
            return None
        token = f"{id(obj):x}"  # the same object, the same token, in every attempt of this driver
        self.apart[token] = obj
        return (_TAG, token)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, refs: dict[str, Any]) -> None:
        super().__init__(file)
        self.refs = refs

    def persistent_load(self, pid: Any) -> Any:
        tag, token = pid
        if tag != _TAG:
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        if token in self.refs:  # sent with this payload: newer than any kept under the same token
            import ray

            _received[token] = ray.get(self.refs[token])
        return _received[token]


def dumps(obj: Any) -> tuple[bytes, dict[str, Any]]:
    """(`obj` pickled, the Ray Datasets left out of it by token)."""
    buffer, apart = io.BytesIO(), {}
    _Pickler(buffer, apart).dump(obj)
    return buffer.getvalue(), apart


def loads(blob: bytes, refs: dict[str, Any] | None = None) -> Any:
    """`dumps`'s bytes loaded, each Ray Dataset taken from `refs` (token -> object reference)
    or, for one this process was given before, from its own."""
    return _Unpickler(io.BytesIO(blob), refs or {}).load()
