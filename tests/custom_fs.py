"""A custom fsspec filesystem with real directories that is neither local nor an object store
(as sftp or HDFS are): it refuses to write a file into a directory that does not exist.
Importable, so that workers unpickle it."""

from __future__ import annotations

import os
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem


class StrictDirFileSystem(AbstractFileSystem):
    """This machine's files, through fsspec's generic code, with directories that must exist."""

    protocol = "strictdir"
    root_marker = "/"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._local = LocalFileSystem()

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if any(m in mode for m in "wa") and not os.path.isdir(os.path.dirname(path)):
            raise FileNotFoundError(f"no directory {os.path.dirname(path)!r} to write {path!r} into")
        return self._local._open(path, mode, **kwargs)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        return self._local.ls(path, detail=detail)

    def info(self, path: str, **kwargs: Any) -> dict:
        return self._local.info(path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._local.makedirs(path, exist_ok=exist_ok)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self._local.mkdir(path, create_parents=create_parents)

    def rm_file(self, path: str) -> None:
        self._local.rm_file(path)

    def rmdir(self, path: str) -> None:
        self._local.rmdir(path)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        if not os.path.isdir(os.path.dirname(path2)):
            raise FileNotFoundError(f"no directory to copy {path2!r} into")
        self._local.cp_file(path1, path2)
