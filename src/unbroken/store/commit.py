"""The checkpoint commit protocol. A checkpoint exists only once its marker is committed.

Local filesystems: every rank writes (and fsyncs) its files into a staging directory
`checkpoint_NNNNNN.tmp-<attempt>/`; the driver writes the marker `.checkpoint.json`
there, fsyncs it, renames the directory into place and fsyncs the parent.
Object stores: files are uploaded into `checkpoint_NNNNNN/` and the marker goes last.

Anything without a verifying marker is not a checkpoint: restore skips it and cleans it up.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from typing import Any

from unbroken.core import faults
from unbroken.errors import CheckpointConflictError, CheckpointNameError, TornCheckpointError
from unbroken.store.storage import Storage
from unbroken.store.storage_errors import is_full

MARKER = ".checkpoint.json"
MARKER_VERSION = 1
_NAME = re.compile(r"^checkpoint_(\d{6,})$")
# A staged checkpoint (always under its default name), or one being deleted (any name).
_LEFTOVER = re.compile(r"^(checkpoint_(\d{6,})\.(tmp|del)-[\w-]+|[^.][^/]*\.del-\d+)$")
# What a name given with train.report(checkpoint_dir_name=...) may be: one path component of
# ordinary characters, not hidden, and clear of the suffixes the protocol itself uses.
_CUSTOM_NAME = re.compile(r"^[\w=+,@-][\w=+,@.-]{0,199}$")
_RESERVED_PARTS = (".tmp-", ".del-", ".corrupt-")
# Below this many bytes a checkpoint's hashes are checked on every restore.
FULL_VERIFY_BYTES = 64 << 20


@dataclass
class FileEntry:
    """One file of a checkpoint, as the rank that wrote it saw it."""

    path: str
    size: int
    crc32: int
    rank: int = 0


@dataclass
class Marker:
    """The commit marker: what a committed checkpoint contains and where it came from."""

    name: str
    iteration: int
    attempt: int
    files: list[FileEntry]
    metrics: dict[str, Any] = field(default_factory=dict)
    committed_at: float = 0.0
    version: int = MARKER_VERSION
    # The validation its report asked for ({"fn_kwargs", "timeout_s"}; see validation_record).
    validation: dict[str, Any] | None = None

    def to_bytes(self) -> bytes:
        raw = asdict(self)
        if raw["validation"] is None:
            del raw["validation"]  # a marker without one reads the same as before validation existed
        return json.dumps(raw, sort_keys=True, default=repr).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Marker:
        raw = json.loads(data)
        raw["files"] = [FileEntry(**f) for f in raw["files"]]
        return cls(**raw)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def checkpoint_name(iteration: int) -> str:
    return f"checkpoint_{iteration:06d}"


def iteration_of(name: str) -> int | None:
    """The iteration a committed checkpoint's directory name carries, or None if it is not one."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def staging_name(iteration: int, attempt: int, storage: Storage, name: str | None = None) -> str:
    """Where ranks write a checkpoint's files before it commits: a temp directory under the
    default name locally (renamed to `name` at the commit, so a custom name needs no cleanup
    rule of its own), the final directory itself on object stores."""
    if storage.renames_atomically:
        return f"{checkpoint_name(iteration)}.tmp-{attempt}"
    return name or checkpoint_name(iteration)


def check_custom_name(name: Any) -> str:
    """`name` if it may name a checkpoint directory (`train.report(checkpoint_dir_name=...)`),
    else CheckpointNameError saying why."""
    if not isinstance(name, str):
        raise CheckpointNameError(f"checkpoint_dir_name must be a str, got {type(name).__name__}")
    if not _CUSTOM_NAME.match(name) or any(part in name for part in _RESERVED_PARTS):
        raise CheckpointNameError(
            f"checkpoint_dir_name {name!r} cannot name a checkpoint directory. Hint: use one path "
            "component of letters, digits and _ = + , @ . - (up to 200 characters, not starting "
            "with '.', without '.tmp-', '.del-' or '.corrupt-'), e.g. f'epoch_{epoch}'")
    if _NAME.match(name):
        raise CheckpointNameError(
            f"checkpoint_dir_name {name!r} looks like a default checkpoint name, which is reserved "
            "for reports without a name. Hint: leave checkpoint_dir_name out to get it, or choose "
            "another name, e.g. f'epoch_{epoch}'")
    return name


def check_name_free(storage: Storage, name: str, in_flight: Collection[str] = ()) -> None:
    """CheckpointNameError if the run directory already has a checkpoint, or anything else,
    called `name`, or a save still `in_flight` has that name. On object stores only a committed
    checkpoint counts: an upload that never committed is staged in place and is written over."""
    taken = name in in_flight or (
        storage.exists(name) if storage.renames_atomically else storage.exists(f"{name}/{MARKER}"))
    if taken:
        raise CheckpointNameError(
            f"checkpoint_dir_name {name!r} is already taken in run {storage.url()!r}: checkpoint "
            "names must be unique within a run. Hint: include the epoch or step in the name, "
            "e.g. f'epoch_{epoch}', so that each report's checkpoint gets its own")


def round_name(iteration: int, named: dict[int, str | None]) -> str:
    """The directory name of the checkpoint of report round `iteration`: the name its ranks
    with files gave (they must agree), or the default one. `named`: rank -> the name it gave."""
    given = {rank: n for rank, n in named.items() if n is not None}
    if len(set(given.values())) > 1:
        listed = ", ".join(f"rank {r}: {n!r}" for r, n in sorted(given.items()))
        raise CheckpointNameError(
            f"report {iteration}: the ranks gave different checkpoint_dir_name values ({listed}) "
            "for one checkpoint. Hint: pass the same name on every rank, e.g. f'epoch_{epoch}'")
    return next(iter(given.values()), None) or checkpoint_name(iteration)


def write_rank_files(storage: Storage, staging: str, local_dir: str, rank: int,
                     guard: Callable[[], None] | None = None) -> list[FileEntry]:
    """Copy one rank's checkpoint directory into the staging area (worker side).

    Each rank uploads its own files, concurrently on object stores: the driver never
    carries checkpoint bytes. `guard()` runs before the first file and after each one, and
    raises to stop a rank whose attempt has ended: on object stores it stages under the
    final name, which a later attempt may have committed meanwhile."""
    guard = guard or (lambda: None)
    pairs = []
    for dirpath, _, filenames in os.walk(local_dir):
        for fn in sorted(filenames):
            src = os.path.join(dirpath, fn)
            rel = os.path.relpath(src, local_dir).replace(os.sep, "/")
            if rel != MARKER:
                pairs.append((src, rel))
    guard()

    def after_each() -> None:
        faults.point("after_file_write")
        guard()

    try:
        sums = storage.put_files([(src, f"{staging}/{rel}") for src, rel in pairs], after_each=after_each)
    except OSError as e:
        if not is_full(e):
            raise
        for _, rel in pairs:  # free what this rank staged, so the failure can still be recorded
            storage.remove(f"{staging}/{rel}")
        size = sum(os.path.getsize(src) for src, _ in pairs)
        name = staging.split(".tmp-")[0]
        raise storage.full_error(f"for {name} (rank {rank}'s part of it)", size) from None
    entries = [FileEntry(rel, size, crc, rank) for (_, rel), (size, crc) in zip(pairs, sums, strict=True)]
    if storage.renames_atomically:  # the staging directory is renamed into place: make it durable first
        dirs = {posixpath.dirname(f"{staging}/{rel}") for _, rel in pairs}
        storage.makedirs(staging)
        for d in sorted(dirs | {staging}, reverse=True):
            storage.fsync_dir(d)
        faults.point("after_fsync")
    return entries


def merge_rank_files(per_rank: list[list[FileEntry]]) -> list[FileEntry]:
    """Merge every rank's file list; the same path from two ranks must have the same bytes."""
    merged: dict[str, FileEntry] = {}
    for entries in per_rank:
        for e in entries:
            seen = merged.get(e.path)
            if seen is not None and (seen.size, seen.crc32) != (e.size, e.crc32):
                raise CheckpointConflictError(
                    f"ranks {seen.rank} and {e.rank} both wrote checkpoint file {e.path!r} with "
                    "different contents. Hint: give each rank's files distinct names, "
                    "e.g. f'shard_{train.get_context().get_world_rank()}.pt'")
            merged.setdefault(e.path, e)
    return sorted(merged.values(), key=lambda e: e.path)


def commit(storage: Storage, staging: str, marker: Marker) -> None:
    """Write the marker last and move the checkpoint into place (driver side)."""
    if storage.renames_atomically:
        storage.makedirs(staging)  # object stores stage in place (and makedirs there probes the bucket)
    faults.point("before_marker")
    storage.write_atomic(f"{staging}/{MARKER}", marker.to_bytes())
    faults.point("after_marker")
    if staging != marker.name:
        faults.point("before_rename")
        storage.rename(staging, marker.name)
        faults.point("after_rename")


def read_marker(storage: Storage, name: str) -> Marker:
    try:
        return Marker.from_bytes(storage.read_bytes(f"{name}/{MARKER}"))
    except FileNotFoundError:
        raise TornCheckpointError(f"{name}: no commit marker") from None
    except (ValueError, TypeError, KeyError) as e:
        raise TornCheckpointError(f"{name}: unreadable commit marker ({e})") from None


def verify(storage: Storage, name: str, full: bool | None = None) -> Marker:
    """Check a checkpoint against its marker: sizes always, hashes when `full` (default: when small)."""
    marker = read_marker(storage, name)
    if full is None:
        full = marker.total_bytes <= FULL_VERIFY_BYTES
    for f in marker.files:
        rel = f"{name}/{f.path}"
        try:
            size = storage.size(rel)
        except FileNotFoundError:
            raise TornCheckpointError(f"{name}: file {f.path!r} is missing") from None
        if size != f.size:
            raise TornCheckpointError(f"{name}: file {f.path!r} has {size} bytes, marker says {f.size}")
        if full and storage.crc32(rel) != f.crc32:
            raise TornCheckpointError(f"{name}: file {f.path!r} does not match its hash (corrupted)")
    return marker


def uncommit_and_delete(storage: Storage, name: str) -> None:
    """Delete a checkpoint, marker first, so a crash midway leaves only an uncommitted leftover."""
    faults.point("before_delete")
    if storage.renames_atomically:
        doomed = f"{name}.del-{os.getpid()}"
        storage.rename(name, doomed)
        faults.point("during_delete")
        storage.remove(doomed)
    else:
        storage.remove(f"{name}/{MARKER}")
        faults.point("during_delete")
        storage.remove(name)


def remove_leftovers(storage: Storage, ended_attempts: int) -> None:
    """Remove what attempts up to `ended_attempts` left uncommitted (local storage).

    Safe without the run's lease once no live driver holds it: a driver that takes the run
    from now on stages under a higher attempt number, and a half-deleted checkpoint is
    garbage to every driver. Restores call it first, so that a run that stopped on a full
    disk gets back the space its torn checkpoint held before anything else is written."""
    if not storage.renames_atomically:
        return  # object stores stage in place: an upload in progress looks like any other uncommitted one
    for name in scan(storage)[1]:
        kind, _, owner = name.rpartition(".")[2].partition("-")
        if kind == "del" or (owner.isdigit() and int(owner) <= ended_attempts):
            storage.remove(name)


def scan(storage: Storage) -> tuple[list[str], list[str]]:
    """(checkpoint directory names, oldest first; uncommitted leftovers) in a run directory.

    A default name (`checkpoint_000007`) is a checkpoint, committed or torn. Any other
    directory is one when it holds a marker (a custom `checkpoint_dir_name`); its marker says
    its iteration, and one whose marker does not read sorts last, so that restore checks it
    first and sets it aside."""
    names: list[tuple[float, str]] = []
    leftovers = []
    for entry in storage.listdir():
        iteration = iteration_of(entry)
        if iteration is not None:
            names.append((iteration, entry))
        elif _LEFTOVER.match(entry):
            leftovers.append(entry)
        elif _may_be_custom(entry) and storage.exists(f"{entry}/{MARKER}"):
            try:
                names.append((read_marker(storage, entry).iteration, entry))
            except TornCheckpointError:
                names.append((float("inf"), entry))
    names.sort()
    return [name for _, name in names], leftovers


def _may_be_custom(entry: str) -> bool:
    return bool(_CUSTOM_NAME.match(entry)) and not any(part in entry for part in _RESERVED_PARTS)
