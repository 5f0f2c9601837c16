"""Files of newline-terminated records opened for appending (result.json), on any storage.

Locally the file is appended to in place, unbuffered, and a torn last record left by a
killed writer is cut first.

Object stores cannot append. There each sync() puts the records since the last one as a
part, `.unbroken/parts/<rel>/<offset>-<length>.part`, named by where its bytes begin in the
whole file and how many there are. The whole file is `rel` followed by the parts that begin
at or after its end; a part that begins before it is already in it. Now and then (when the
parts add up to as much as `rel`, or number MAX_PARTS) and at close() the parts are folded
into `rel`: one put of the whole file, then the parts are removed. A kill between the two
leaves parts that the rule above ignores and the next writer removes. A sync costs one put
of its own records; the folds at doubling sizes add up to a constant number of puts per
byte, and the MAX_PARTS cap (how many parts a reader of a live run fetches) adds at most
1/MAX_PARTS of a rewrite per sync.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Protocol

from unbroken.core import faults
from unbroken.errors import StorageError
from unbroken.store.manifest_base import META_DIR
from unbroken.store.storage import Storage
from unbroken.store.storage_errors import is_full

MAX_PARTS = 64  # parts a reader of an object store may have to fetch besides the file


def open_appender(storage: Storage, rel: str) -> Appender:
    """`rel` on `storage` opened for appending records."""
    if storage.is_local:
        return _LocalAppender(storage, rel)
    return _PartsAppender(storage, rel)


def read_whole(storage: Storage, rel: str) -> bytes:
    """Every record of `rel`, its parts included (object stores), without a torn last record;
    b"" when there is none. FileNotFoundError never."""
    try:
        base = storage.read_bytes(rel)
    except FileNotFoundError:
        base = b""
    newer, _ = _parts(storage, rel, len(base))
    data = base + b"".join(storage.read_bytes(part) for _, part in newer)
    return data[:data.rfind(b"\n") + 1]


def read_tail(storage: Storage, rel: str, window: int) -> tuple[bytes, bool] | None:
    """The end of the whole of `rel` (None where it does not exist): its newest part, which
    holds whole records, or else its last `window` bytes. The flag says whether more comes
    before (the first record of the bytes may then be cut)."""
    try:
        size = storage.size(rel)
    except FileNotFoundError:
        size = None
    newer, _ = _parts(storage, rel, size or 0)
    if newer:
        return storage.read_bytes(newer[-1][1]), True
    if size is None:
        return None
    with storage.open_read(rel) as f:
        f.seek(max(0, size - window))
        return f.read(), size > window


def _parts_dir(rel: str) -> str:
    return f"{META_DIR}/parts/{rel}"


def _parts(storage: Storage, rel: str, size: int) -> tuple[list[tuple[int, str]], list[str]]:
    """([(length, path)] of the parts that continue `rel` (of `size` bytes), in order; the
    parts already folded into it). Object stores only: elsewhere there are none."""
    if storage.is_local:
        return [], []
    found = []
    for name in storage.listdir(_parts_dir(rel)):
        offset, _, length = name.removesuffix(".part").partition("-")
        if name.endswith(".part") and offset.isdigit() and length.isdigit():
            found.append((int(offset), int(length), f"{_parts_dir(rel)}/{name}"))
    found.sort()
    newer, end = [], size
    for offset, length, path in found:
        if offset == end:
            newer.append((length, path))
            end += length
    return newer, [path for offset, _, path in found if offset < size]


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


class _PartsAppender:
    """Object stores: each sync() puts a part; parts are folded into the file now and then
    (see the module docstring)."""

    def __init__(self, storage: Storage, rel: str) -> None:
        self._storage, self._rel = storage, rel
        try:
            self._size = storage.size(rel)
        except FileNotFoundError:
            self._size = 0
        newer, folded = _parts(storage, rel, self._size)
        for path in folded:
            storage.remove(path)  # left by a fold that was cut short
        self._parts = [path for _, path in newer]
        self._parts_bytes = sum(length for length, _ in newer)
        self._pending = bytearray()

    def append(self, data: bytes) -> None:
        self._pending += data

    def sync(self) -> None:
        if not self._pending:
            return
        offset = self._size + self._parts_bytes
        path = f"{_parts_dir(self._rel)}/{offset:016d}-{len(self._pending):010d}.part"
        self._storage.write_atomic(path, bytes(self._pending))
        self._parts.append(path)
        self._parts_bytes += len(self._pending)
        self._pending.clear()
        if self._parts_bytes >= self._size or len(self._parts) >= MAX_PARTS:
            self._fold()

    def _fold(self) -> None:
        data = read_whole(self._storage, self._rel)
        self._storage.write_atomic(self._rel, data)
        faults.point("after_fold")
        for path in self._parts:
            self._storage.remove(path)
        self._size, self._parts, self._parts_bytes = len(data), [], 0

    def close(self) -> None:
        self.sync()
        if self._parts:
            self._fold()


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
