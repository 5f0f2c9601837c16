"""Files of newline-terminated records opened for appending (result.json), on any storage.

Locally the file is appended to in place, unbuffered, and a torn last record left by a
killed writer is cut first; object stores cannot append, so there the whole file is kept in
memory and rewritten by each sync() in one put.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any, Protocol

from unbroken.errors import StorageError
from unbroken.store.storage import Storage
from unbroken.store.storage_errors import is_full


def open_appender(storage: Storage, rel: str, initial: Callable[[], bytes]) -> Appender:
    """`rel` on `storage` opened for appending records; on an object store its contents start
    as `initial()` (what is already there, as the caller read it)."""
    if storage.is_local:
        return _LocalAppender(storage, rel)
    return _RewriteAppender(storage, rel, initial())


class Appender(Protocol):
    """A file of records opened for appending (`open_appender`)."""

    def append(self, data: bytes) -> None:
        """Add one or more whole records (ending in a newline)."""

    def sync(self) -> None:
        """Make everything appended so far durable."""

    def close(self) -> None:
        """Release the file (after a last sync() where that is wanted)."""


class _LocalAppender:
    """Unbuffered appends: a record that fails to go out (a full disk) is cut off again, not
    left half-written, nor in a buffer for a later flush to write after the next record."""

    def __init__(self, storage: Storage, rel: str) -> None:
        self._storage, self._rel = storage, rel
        self._file = open(storage.path(rel), "a+b", buffering=0)
        _drop_torn_tail(self._file)
        self._end = self._file.seek(0, os.SEEK_END)  # this writer is the file's only one

    def append(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[self._file.write(view):]
        except OSError as e:
            with contextlib.suppress(OSError):
                self._file.truncate(self._end)  # no half record: the next append starts a line
            if is_full(e):
                raise self._storage.full_error(f"writing {self._rel}", len(data)) from None
            raise StorageError(f"cannot append to {self._storage.url(self._rel)!r}: {e}") from None
        self._end += len(data)

    def sync(self) -> None:
        try:
            os.fsync(self._file.fileno())
        except OSError as e:
            raise StorageError(f"cannot write {self._storage.url(self._rel)!r}: {e}") from None

    def close(self) -> None:
        self._file.close()


class _RewriteAppender:
    """Object stores: the file's bytes, rewritten whole (one put) at each sync()."""

    def __init__(self, storage: Storage, rel: str, initial: bytes) -> None:
        self._storage, self._rel = storage, rel
        self._data = bytearray(initial)

    def append(self, data: bytes) -> None:
        self._data += data

    def sync(self) -> None:
        self._storage.write_atomic(self._rel, bytes(self._data))

    def close(self) -> None:
        pass


def _drop_torn_tail(f: Any) -> None:
    """Cut a last line that a killed writer left without its newline, so appends start clean."""
    end = f.seek(0, os.SEEK_END)
    if end == 0:
        return
    f.seek(max(0, end - 65536))
    tail = f.read()
    if tail.endswith(b"\n"):
        return
    cut = tail.rfind(b"\n")
    if cut < 0 and end > len(tail):
        return  # a single line longer than the window: leave it to the reader to skip
    f.truncate(end - len(tail) + cut + 1)
