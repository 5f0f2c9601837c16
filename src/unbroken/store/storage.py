"""Storage: an fsspec filesystem and a root path, with the few durable operations runs need.

Every byte unbroken stores goes through this module, local paths included, so object
stores need no separate code path. On local filesystems writes are fsynced and
replacements are atomic renames; on object stores a single put is atomic by itself, and
every call is retried through transient faults (unbroken.store.storage_errors).

What a filesystem is (local, an object store, one with directories of its own) is decided by
unbroken.store.filesystems; the writes on this machine's disk are unbroken.store.local_disk's.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import posixpath
import shutil
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from unbroken.core import faults
from unbroken.core.units import format_bytes
from unbroken.errors import StorageError, StorageFullError
from unbroken.store import filesystems, local_disk
from unbroken.store.storage_errors import (
    PreconditionFailed,
    call_with_retries,
    is_full,
    is_not_implemented,
    is_precondition_failed,
)

log = logging.getLogger("unbroken")
T = TypeVar("T")

_CHUNK = 8 << 20

CREATE = "<create>"  # write_conditional(expect=CREATE): only if the object does not exist yet


def split_run_url(url: str) -> tuple[str, str]:
    """(storage_path, name) of a run's or a sweep's URL, `<storage_path>/<name>`: what
    RunConfig(storage_path=..., name=...) takes to address it again."""
    name = url.rstrip("/").rsplit("/", 1)[-1]
    return url[: -len(name) - 1], name


class Storage:
    """A directory on some filesystem. Relative paths use '/' on every filesystem."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str) -> None:
        # A DirFileSystem is a prefix over another filesystem: work on that one, with the full
        # path, and give URLs back relative to the prefix (`url`, `filesystem_arg`).
        self._layers, fs, root = filesystems.below_prefixes(fs, root)
        self.is_local = isinstance(fs, LocalFileSystem)
        if self.is_local:
            root = os.path.abspath(os.path.expanduser(root))
        self.fs = fs
        self.root = root.rstrip("/") or "/"
        self._has_dirs = filesystems.has_dirs(fs)  # directories created before files go into them

    def __reduce__(self) -> tuple:
        # Over a DirFileSystem, travel as that filesystem and the path below its prefix, so that
        # a process elsewhere resolves the prefix as its filesystem does there.
        return (Storage, (self._layers[0], self.url()) if self._layers else (self.fs, self.root))

    @classmethod
    def from_url(cls, url: str, filesystem: fsspec.AbstractFileSystem | None = None) -> Storage:
        """Open `url` (a local path or any fsspec URL); `filesystem` overrides the URL's protocol."""
        url = os.fspath(url)
        if filesystem is not None:
            return cls(filesystem, filesystem._strip_protocol(url))
        return cls(*filesystems.open_url(url))

    # -- addressing -----------------------------------------------------------------
    def path(self, rel: str = "") -> str:
        """The filesystem path of `rel` below the root."""
        return posixpath.join(self.root, rel) if rel else self.root

    def url(self, rel: str = "") -> str:
        """A string that Storage.from_url opens again, with `filesystem_arg` (a plain path for
        local storage; a path below its prefix on a DirFileSystem)."""
        path = self.path(rel)
        if self._layers:
            for layer in reversed(self._layers):
                path = layer._relpath(path)
            return path
        if self.is_local:
            return path
        return self.fs.unstrip_protocol(path)

    def fs_path(self, rel: str = "") -> str:
        """The path of `rel` on `filesystem` (Ray's `Result.path` / `Checkpoint.path`): the URL
        without its scheme."""
        return self.url(rel) if self._layers else self.path(rel)

    def child(self, rel: str) -> Storage:
        return self._at(self.path(rel))

    def parent(self) -> Storage:
        """The directory above this one, on the same filesystem."""
        return self._at(posixpath.dirname(self.root) or "/")

    def _at(self, root: str) -> Storage:
        other = copy.copy(self)
        other.root = root.rstrip("/") or "/"
        return other

    def local_path(self, rel: str = "") -> str | None:
        """The path of `rel` on this machine's filesystem, or None on an object store."""
        return self.path(rel) if self.is_local else None

    @property
    def filesystem_arg(self) -> fsspec.AbstractFileSystem | None:
        """What to pass as `filesystem` along with url() so that it opens this storage again
        (Checkpoint, Result.from_path): None where the path says it all (local), else the
        filesystem itself, which may carry options the URL lacks."""
        if self._layers:
            return self._layers[0]
        return None if self.is_local else self.fs

    @property
    def filesystem(self) -> fsspec.AbstractFileSystem:
        """The filesystem `fs_path` is a path on."""
        return self.filesystem_arg or self.fs

    @property
    def renames_atomically(self) -> bool:
        """Whether rename() moves a directory in one atomic step (local filesystems), so that
        a writer can stage files under a temporary name and rename them into place. On
        object stores rename is a copy, so writers work in place there."""
        return self.is_local

    # -- retries --------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Run one remote operation, retrying transient faults with backoff for up to
        UNBROKEN_STORAGE_RETRY_S seconds. Local filesystems are called once."""
        if self.is_local:
            return fn()
        return call_with_retries(self.fs, self.url, what, fn)

    def _fresh(self, rel: str) -> str:
        """The path of `rel`, with any cached listing of it and of the directories above it
        dropped: other processes write too, and a listing this process cached earlier must
        never decide what a read finds (s3fs answers a read of a file missing from a cached
        listing of its directory with FileNotFoundError). Every read and every operation
        that lists goes through it; an in-memory drop, no request."""
        path = self.path(rel)
        if not self.is_local:
            self.fs.invalidate_cache(path)
        return path

    # -- queries --------------------------------------------------------------------
    def exists(self, rel: str = "") -> bool:
        return self._call(f"checking {rel or '.'}", lambda: self.fs.exists(self._fresh(rel)))

    def isdir(self, rel: str = "") -> bool:
        return self._call(f"checking {rel or '.'}", lambda: self.fs.isdir(self._fresh(rel)))

    def listdir(self, rel: str = "") -> list[str]:
        """Names directly under `rel`, or [] if it does not exist."""
        if self.is_local:
            return local_disk.listdir(self.path(rel))
        try:
            entries = self._call(f"listing {rel or '.'}",
                                 lambda: self.fs.ls(self._fresh(rel), detail=False, refresh=True))
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries)

    def size(self, rel: str) -> int:
        return int(self._call(f"reading {rel}", lambda: self.fs.size(self._fresh(rel))))

    # -- reading --------------------------------------------------------------------
    def read_bytes(self, rel: str) -> bytes:
        return self._call(f"reading {rel}", lambda: self.fs.cat_file(self._fresh(rel)))

    @property
    def conditional_writes(self) -> bool:
        """Whether write_conditional is race-free here (S3 and compatible servers)."""
        return not self.is_local and "s3" in tuple(self.fs.protocol)

    def read_versioned(self, rel: str) -> tuple[bytes, str | None]:
        """The bytes of `rel` and a version tag for write_conditional (None where the
        filesystem has no conditional writes)."""
        if not self.conditional_writes:
            return self.read_bytes(rel), None
        for _ in range(3):  # read and version must belong to the same write
            data = self.read_bytes(rel)
            etag = self._call(f"reading {rel}", lambda: self.fs.info(self._fresh(rel))).get("ETag")
            if etag is None or etag.strip('"') == hashlib.md5(data).hexdigest():
                break
        return data, etag

    def read_json(self, rel: str) -> Any:
        return json.loads(self.read_bytes(rel))

    def open_read(self, rel: str) -> Any:
        """`rel` opened for reading in binary mode, as it is on storage now (its size is not
        taken from a cached listing), for reads in chunks or from an offset."""
        return self._call(f"reading {rel}", lambda: self.fs.open(self._fresh(rel), "rb"))

    def crc32(self, rel: str, advance: Callable[[int], None] | None = None) -> int:
        """The CRC-32 of `rel`, read in chunks; `advance(n)` is told each chunk's size (progress)."""
        def read() -> int:
            crc = 0
            with self.open_read(rel) as f:
                while chunk := f.read(_CHUNK):
                    crc = zlib.crc32(chunk, crc)
                    if advance is not None:
                        advance(len(chunk))
            return crc

        return self._call(f"reading {rel}", read)

    # -- writing --------------------------------------------------------------------
    def makedirs(self, rel: str = "") -> None:
        try:
            self._call(f"creating {rel or '.'}", lambda: self.fs.makedirs(self.path(rel), exist_ok=True))
        except OSError as e:  # no permission, read-only filesystem, a file in the way
            raise StorageError(f"cannot write to storage {self.url(rel)!r}: {e}. "
                               "Hint: choose a storage_path you can write to") from None

    def _parents(self, paths: list[str]) -> None:
        """Create the directories `paths` (full paths) go into, where the filesystem has
        real directories and is not this machine's (sftp, HDFS, a custom one)."""
        if self._has_dirs:
            for parent in sorted({posixpath.dirname(p) for p in paths}):
                self._call(f"creating {parent}", lambda p=parent: self.fs.makedirs(p, exist_ok=True))

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Replace `rel` with `data` so that readers see the old or the new bytes, never a mix."""
        path = self.path(rel)
        if not self.is_local:
            self._parents([path])
            self._call(f"writing {rel}", lambda: self.fs.pipe_file(path, data))
            return
        self._local_write(rel, data, exclusive=False)

    def _local_write(self, rel: str, data: bytes, exclusive: bool) -> None:
        """Write `data` to `rel` through a fsynced temp file (`local_disk.write_then_move`):
        replacing what is there, or, `exclusive`, only if nothing is (PreconditionFailed then)."""
        path = self.path(rel)
        try:
            written = local_disk.write_then_move(path, data, exclusive)
        except OSError as e:
            if is_full(e):
                raise self.full_error(f"writing {rel}", len(data)) from None
            raise StorageError(f"cannot write {path!r}: {e}. "
                               "Hint: choose a storage_path you can write to") from None
        if not written:
            raise PreconditionFailed(f"{rel} exists already")
        local_disk.fsync_dir(os.path.dirname(path))

    def free_bytes(self) -> int | None:
        """Free space where this storage lives (None where a filesystem cannot tell)."""
        return local_disk.free_bytes(self.root) if self.is_local else None

    def full_error(self, what: str, needed: int | None) -> StorageFullError:
        """The error for running out of space while `what` (which needed `needed` bytes)."""
        free = self.free_bytes()
        sizes = ", ".join(x for x in (f"{format_bytes(needed)} needed" if needed is not None else "",
                                      f"{format_bytes(free)} free" if free is not None else "") if x)
        return StorageFullError(
            f"storage {self.url()!r} is full: no space left {what}" + (f" ({sizes})" if sizes else "")
            + ". Hint: keep fewer checkpoints with CheckpointConfig(num_to_keep=N) (a restore with "
            "run_config=RunConfig(checkpoint_config=...) prunes before its first checkpoint), or "
            "make room; then restore the run: it resumes from its latest committed checkpoint")

    def write_conditional(self, rel: str, data: bytes, expect: str | None) -> str | None:
        """Write `rel` only if it is still at version `expect` (CREATE: only if absent) and
        return the new version; raise PreconditionFailed otherwise. Object stores that support
        conditional writes make this race-free; elsewhere it writes atomically and returns None
        (callers read back to detect a race), except that CREATE on a local filesystem is
        race-free too."""
        if self.is_local and expect == CREATE:
            self._local_write(rel, data, exclusive=True)
            return None
        if not self.conditional_writes or expect is None:
            self.write_atomic(rel, data)
            return None
        condition = {"mode": "create"} if expect == CREATE else {"IfMatch": expect}
        try:
            out = self._call(f"writing {rel}", lambda: self.fs.pipe_file(self.path(rel), data, **condition))
        except (FileExistsError, OSError) as e:
            if isinstance(e, FileExistsError) or is_precondition_failed(e):
                raise PreconditionFailed(str(e)) from None
            if not is_not_implemented(e):
                raise
            log.warning("storage %s does not support conditional writes; %s is written without "
                        "them (one driver per run is then checked by reading back)", self.url(), rel)
            self.write_atomic(rel, data)
            return None
        return str((out or {}).get("ETag")) if isinstance(out, dict) and out.get("ETag") else None

    def write_json(self, rel: str, obj: Any) -> None:
        self.write_atomic(rel, json.dumps(obj, indent=1, sort_keys=True, default=repr).encode())

    def put_file(self, local_src: str, rel: str) -> tuple[int, int]:
        """Copy a local file to `rel`, durably; returns its (size, crc32)."""
        if not self.is_local:
            return self.put_files([(local_src, rel)])[0]
        return local_disk.copy_file(local_src, self.path(rel))

    def put_files(self, pairs: list[tuple[str, str]],
                  after_each: Callable[[], None] | None = None) -> list[tuple[int, int]]:
        """Copy local files to (relative) destinations; returns each one's (size, crc32).
        On object stores the uploads run concurrently (the filesystem's own batching).
        `after_each` is called after each file is written, locally, and once after the whole
        batch on object stores."""
        if self.is_local:
            sums = []
            for src, rel in pairs:
                sums.append(self.put_file(src, rel))
                if after_each is not None:
                    after_each()
            return sums
        sums = [local_disk.file_sums(src) for src, _ in pairs]
        if pairs:
            sources, targets = [src for src, _ in pairs], [self.path(rel) for _, rel in pairs]
            self._parents(targets)
            self._call(f"uploading {len(pairs)} file(s) to {posixpath.dirname(pairs[0][1])}",
                       lambda: self.fs.put(sources, targets))
        if after_each is not None:
            after_each()
        return sums

    def get_file(self, rel: str, local_dst: str) -> None:
        """Copy `rel` to a local file (creating its directory)."""
        os.makedirs(os.path.dirname(local_dst) or ".", exist_ok=True)
        if self.is_local:
            shutil.copyfile(self.path(rel), local_dst)
            return
        self._call(f"downloading {rel}", lambda: self.fs.get_file(self._fresh(rel), local_dst))

    def rename(self, src_rel: str, dst_rel: str) -> None:
        """Rename a directory or file; atomic and durable on local filesystems. Elsewhere a
        directory is copied file by file, then removed: not atomic, so callers there never
        rely on it for a commit (a checkpoint is staged in place)."""
        if self.is_local:
            os.rename(self.path(src_rel), self.path(dst_rel))
            local_disk.fsync_dir(os.path.dirname(self.path(dst_rel)))
        else:
            self._call(f"renaming {src_rel}", lambda: self._copy_then_remove(src_rel, dst_rel))

    def _copy_then_remove(self, src_rel: str, dst_rel: str) -> None:
        # fsspec's recursive mv also copies the directory's own key, which no object holds.
        src, dst = self._fresh(src_rel), self._fresh(dst_rel)
        found = self.fs.find(src)
        if found in ([], [src]):
            self._parents([dst])
            self.fs.mv(src, dst)  # a file (or nothing: FileNotFoundError)
            return
        self._parents([dst + path[len(src):] for path in found])
        for path in found:
            self.fs.copy(path, dst + path[len(src):])
            faults.point("during_copy_rename")
        self.fs.rm(src, recursive=True)

    def fsync_dir(self, rel: str = "") -> None:
        if self.is_local:
            local_disk.fsync_dir(self.path(rel))

    def remove(self, rel: str) -> None:
        """Remove a file or a directory tree; a missing path is not an error."""
        path = self._fresh(rel)

        def remove() -> None:
            if self.fs.isdir(path):
                self.fs.rm(path, recursive=True)
            else:
                self.fs.rm_file(path)

        try:
            self._call(f"removing {rel}", remove)
        except FileNotFoundError:
            pass

    def remove_stale_temps(self, rel: str = "") -> None:
        """Remove the temp files of atomic writes that another process left behind in `rel`
        (it was killed between writing and renaming). Only safe while holding the run's lease."""
        if self.is_local:  # object stores replace files in one put: no temp files
            local_disk.remove_stale_temps(self.path(rel))

    def walk_files(self, rel: str = "") -> list[str]:
        """Every file below `rel`, as paths relative to it."""
        base = self.path(rel).rstrip("/") + "/"
        found = self._call(f"listing {rel or '.'}", lambda: self.fs.find(self._fresh(rel)))
        return sorted(p[len(base):] if p.startswith(base) else p for p in found)
