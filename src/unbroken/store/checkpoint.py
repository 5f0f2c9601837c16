"""Checkpoint: a handle to a directory of files on some storage."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import fsspec

from unbroken.store.commit import MARKER
from unbroken.store.storage import Storage

METADATA = ".metadata.json"


class Checkpoint:
    """A directory of checkpoint files, local or on any fsspec filesystem.

    Workers build one with `Checkpoint.from_directory(local_dir)` and pass it to
    `train.report`; `train.get_checkpoint()` and `Result.checkpoint` return committed ones.

    Like Ray's, `path` is the directory's path on `filesystem` (no URL scheme):
    `Checkpoint(path=c.path, filesystem=c.filesystem)` is the same checkpoint again. `url`
    is `path` with its scheme (`s3://bucket/...`; a local path as it is), which opens it
    with no `filesystem` given (unless the filesystem carries options of its own).
    """

    def __init__(self, path: str | os.PathLike, filesystem: fsspec.AbstractFileSystem | None = None) -> None:
        self._storage = Storage.from_url(os.fspath(path), filesystem)
        self.path = self._storage.fs_path()
        self.filesystem = self._storage.filesystem  # what `path` is on
        self.url = self._storage.url()

    @classmethod
    def from_directory(cls, path: str | os.PathLike) -> Checkpoint:
        """Wrap a local directory (nothing is copied until it is reported)."""
        return cls(os.path.abspath(os.fspath(path)))

    def __repr__(self) -> str:
        """As Ray's: `Checkpoint(filesystem=local, path=/tmp/run/checkpoint_000003)`."""
        protocol = self.filesystem.protocol
        name = protocol if isinstance(protocol, str) else protocol[0]
        return f"Checkpoint(filesystem={'local' if name in ('file', 'local') else name}, path={self.path})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Checkpoint) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    @property
    def is_local(self) -> bool:
        return self._storage.is_local

    def to_directory(self, path: str | os.PathLike | None = None) -> str:
        """Copy the checkpoint's files into a local directory (a new temp one by default)."""
        dst = os.fspath(path) if path is not None else tempfile.mkdtemp(prefix="unbroken-ckpt-")
        os.makedirs(dst, exist_ok=True)
        for rel in self._storage.walk_files():
            if rel != MARKER:
                self._storage.get_file(rel, os.path.join(dst, rel))
        return dst

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[str]:
        """A local directory with the files: the checkpoint itself when local, else a temp copy."""
        local = self._storage.local_path()
        if local is not None:
            yield local
            return
        tmp = self.to_directory()
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def to_state_dict(self) -> dict[str, Any]:
        """The whole state of a TrainState checkpoint, in this process, by name: {"model":
        state_dict, "optimizer": ..., "scheduler": ..., "loader": ..., <extras>} (the random
        generators left out). A sharded checkpoint (FSDP2, tensor parallel) is gathered from
        every rank's shards, with no process group: for evaluating or exporting a model in one
        plain process, `model.load_state_dict(checkpoint.to_state_dict()["model"])`. It needs
        memory for the whole model. See docs/large-models.md."""
        from unbroken.state.state_file import load_full_state

        with self.as_directory() as d:
            return load_full_state(d)

    def get_metadata(self) -> dict[str, Any]:
        """User metadata stored with the checkpoint ({} if none)."""
        try:
            return json.loads(self._storage.read_bytes(METADATA))
        except FileNotFoundError:
            return {}

    def set_metadata(self, metadata: dict[str, Any]) -> None:
        """Store user metadata; only before the checkpoint is reported (committed ones are immutable)."""
        if self._storage.exists(MARKER):
            raise ValueError(f"{self.url} is a committed checkpoint; committed checkpoints are "
                             "immutable. Hint: set metadata before passing it to train.report")
        self._storage.write_atomic(METADATA, json.dumps(metadata, default=repr).encode())

    def update_metadata(self, metadata: dict[str, Any]) -> None:
        self.set_metadata({**self.get_metadata(), **metadata})
