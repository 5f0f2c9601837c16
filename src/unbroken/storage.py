"""Storage: an fsspec filesystem and a root path, with the few durable operations runs need.

Every byte unbroken stores goes through this module, local paths included, so object
stores need no separate code path. On local filesystems writes are fsynced and
replacements are atomic renames; on object stores a single put is atomic by itself.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import zlib
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from unbroken import faults
from unbroken.errors import StorageError

_ATOMIC_TEMP = re.compile(r"\.tmp-(\d+)$")

_CHUNK = 8 << 20

# fsspec protocol -> the package that provides it, for the "not installed" hint.
_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs",
             "abfs": "adlfs", "hdfs": "pyarrow", "sftp": "paramiko"}


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Storage:
    """A directory on some filesystem. Relative paths use '/' on every filesystem."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/") or "/"
        self.is_local = isinstance(fs, LocalFileSystem)

    @classmethod
    def from_url(cls, url: str, filesystem: fsspec.AbstractFileSystem | None = None) -> Storage:
        """Open `url` (a local path or any fsspec URL); `filesystem` overrides the URL's protocol."""
        url = os.fspath(url)
        if filesystem is not None:
            return cls(filesystem, filesystem._strip_protocol(url))
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        try:
            fs, path = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as e:
            package = _PACKAGES.get(protocol, f"the fsspec implementation for '{protocol}://'")
            raise StorageError(
                f"cannot open storage {url!r}: the filesystem for '{protocol}://' is not installed "
                f"({e}). Hint: pip install {package}"
            ) from None
        if isinstance(fs, LocalFileSystem):
            path = os.path.abspath(os.path.expanduser(path))
        return cls(fs, path)

    # -- addressing -----------------------------------------------------------------
    def path(self, rel: str = "") -> str:
        """The filesystem path of `rel` below the root."""
        return posixpath.join(self.root, rel) if rel else self.root

    def url(self, rel: str = "") -> str:
        """A string that Storage.from_url opens again (a plain path for local storage)."""
        path = self.path(rel)
        if self.is_local:
            return path
        return self.fs.unstrip_protocol(path)

    def child(self, rel: str) -> Storage:
        return Storage(self.fs, self.path(rel))

    # -- queries --------------------------------------------------------------------
    def exists(self, rel: str = "") -> bool:
        return self.fs.exists(self.path(rel))

    def isdir(self, rel: str = "") -> bool:
        return self.fs.isdir(self.path(rel))

    def listdir(self, rel: str = "") -> list[str]:
        """Names directly under `rel`, or [] if it does not exist."""
        if self.is_local:
            try:
                return sorted(os.listdir(self.path(rel)))
            except (FileNotFoundError, NotADirectoryError):
                return []
        try:
            entries = self.fs.ls(self.path(rel), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries)

    def size(self, rel: str) -> int:
        return int(self.fs.size(self.path(rel)))

    # -- reading --------------------------------------------------------------------
    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self.path(rel))

    def read_json(self, rel: str) -> Any:
        return json.loads(self.read_bytes(rel))

    def crc32(self, rel: str) -> int:
        crc = 0
        with self.fs.open(self.path(rel), "rb") as f:
            while chunk := f.read(_CHUNK):
                crc = zlib.crc32(chunk, crc)
        return crc

    # -- writing --------------------------------------------------------------------
    def makedirs(self, rel: str = "") -> None:
        try:
            self.fs.makedirs(self.path(rel), exist_ok=True)
        except OSError as e:  # no permission, read-only filesystem, a file in the way
            raise StorageError(f"cannot write to storage {self.url(rel)!r}: {e}. "
                               "Hint: choose a storage_path you can write to") from None

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Replace `rel` with `data` so that readers see the old or the new bytes, never a mix."""
        path = self.path(rel)
        if not self.is_local:
            self.fs.pipe_file(path, data)
            return
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            faults.point("before_replace")
            os.replace(tmp, path)
        except OSError as e:
            raise StorageError(f"cannot write {path!r}: {e}. "
                               "Hint: choose a storage_path you can write to") from None
        _fsync_dir(os.path.dirname(path))

    def write_json(self, rel: str, obj: Any) -> None:
        self.write_atomic(rel, json.dumps(obj, indent=1, sort_keys=True, default=repr).encode())

    def put_file(self, local_src: str, rel: str) -> tuple[int, int]:
        """Copy a local file to `rel`, durably; returns its (size, crc32)."""
        path = self.path(rel)
        crc, size = 0, 0
        with open(local_src, "rb") as src:
            if self.is_local:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                dst_cm = open(path, "wb")
            else:
                dst_cm = self.fs.open(path, "wb")
            with dst_cm as dst:
                buf = bytearray(_CHUNK)
                view = memoryview(buf)
                while n := src.readinto(buf):
                    crc = zlib.crc32(view[:n], crc)
                    dst.write(view[:n])
                    size += n
                if self.is_local:
                    dst.flush()
                    os.fsync(dst.fileno())
        return size, crc

    def get_file(self, rel: str, local_dst: str) -> None:
        os.makedirs(os.path.dirname(local_dst) or ".", exist_ok=True)
        self.fs.get_file(self.path(rel), local_dst)

    def rename(self, src_rel: str, dst_rel: str) -> None:
        """Rename a directory or file; atomic and durable on local filesystems."""
        if self.is_local:
            os.rename(self.path(src_rel), self.path(dst_rel))
            _fsync_dir(os.path.dirname(self.path(dst_rel)))
        else:
            self.fs.mv(self.path(src_rel), self.path(dst_rel), recursive=True)

    def fsync_dir(self, rel: str = "") -> None:
        if self.is_local:
            _fsync_dir(self.path(rel))

    def remove(self, rel: str) -> None:
        """Remove a file or a directory tree; a missing path is not an error."""
        path = self.path(rel)
        try:
            if self.fs.isdir(path):
                self.fs.rm(path, recursive=True)
            else:
                self.fs.rm_file(path)
        except FileNotFoundError:
            pass

    def remove_stale_temps(self, rel: str = "") -> None:
        """Remove the temp files of atomic writes that another process left behind in `rel`
        (it was killed between writing and renaming). Only safe while holding the run's lease."""
        if not self.is_local:
            return  # object stores replace files in one put: no temp files
        for name in self.listdir(rel):
            m = _ATOMIC_TEMP.search(name)
            full = os.path.join(self.path(rel), name)
            if m and int(m.group(1)) != os.getpid() and os.path.isfile(full):
                os.remove(full)

    def walk_files(self, rel: str = "") -> list[str]:
        """Every file below `rel`, as paths relative to it."""
        base = self.path(rel).rstrip("/") + "/"
        return sorted(p[len(base):] if p.startswith(base) else p
                      for p in self.fs.find(self.path(rel)))
