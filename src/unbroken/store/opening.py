"""Create or restore: how a run (`restore.open_run`) or a sweep (`Tuner._open`) directory is
opened for writing.

1. `existing()` applies the `resume` mode, the identity check and the fresh-directory
   check, and writes nothing.
2. The caller decides whether there is anything to do (a finished run returns its result).
3. `leased()` frees what a dead driver left, takes the lease, removes stale temps and reads
   the manifest again while holding the lease.

Each caller passes a `Kind`, which says what differs between runs and sweeps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from unbroken.errors import RunExistsError, RunNotFoundError
from unbroken.store.lease import Lease, live_holder
from unbroken.store.manifest import META_DIR, remove_stale_temps
from unbroken.store.storage import Storage, split_run_url


class Manifest(Protocol):
    """A run's or a sweep's manifest, as far as opening one needs."""

    def to_bytes(self) -> bytes: ...


M = TypeVar("M", bound=Manifest)


@dataclass(frozen=True)
class Kind(Generic[M]):
    """What differs between opening a run and opening a sweep."""

    noun: str  # "run" or "sweep", as the error messages name it
    load: Callable[[Storage], M]  # the manifest's newest valid generation
    exists: Callable[[Storage], bool]  # whether there is a manifest
    # What a first fit() killed before its manifest existed may have left, at the top and
    # in .unbroken/ (besides atomic-write temps); a directory holding only that is fresh.
    first_files: frozenset[str]
    first_meta: frozenset[str]
    # What to remove from an existing one before taking its lease, once no live driver holds
    # it (a torn checkpoint's space, so that a run stopped by a full disk can restart).
    free: Callable[[Storage, M], None] | None = None


def is_fresh_dir(kind: Kind[Any], storage: Storage) -> bool:
    """Absent, empty, or holding only what a first fit() writes before the manifest (it was
    killed)."""
    entries = [e for e in storage.listdir() if e not in kind.first_files and ".tmp-" not in e]
    if not entries:
        return True
    return entries == [META_DIR] and all(
        e in kind.first_meta or ".tmp-" in e for e in storage.listdir(META_DIR))


def existing(kind: Kind[M], storage: Storage, *, exists: bool, restored: bool, resume: str,
             check_identity: Callable[[M], None]) -> M | None:
    """The manifest of the run or sweep at `storage` (`exists`: the caller found one there),
    or None where a new one may be created. Raises, before anything is written, where
    RunConfig(resume=...) refuses, where the identity differs (`check_identity`, skipped on
    an explicit restore) or where the directory holds something else."""
    path = storage.url()
    if not exists and not is_fresh_dir(kind, storage):
        exists = kind.exists(storage)  # a driver racing this one may have created it just now
        if not exists:
            raise RunExistsError(f"{path!r} exists and is not an unbroken {kind.noun}; it is left "
                                 "untouched. Hint: choose another RunConfig(name=...) or storage_path")
    if exists:
        manifest = kind.load(storage)
        if not restored:
            if resume == "never":
                raise RunExistsError(
                    f"a {kind.noun} already exists at {path!r} and RunConfig(resume='never') refuses to "
                    "continue it. Hint: choose a new name, or use resume='auto' to continue it")
            check_identity(manifest)
        return manifest
    if resume == "must":
        raise RunNotFoundError(f"no {kind.noun} at {path!r} and RunConfig(resume='must') requires one. "
                               "Hint: check name and storage_path, or use resume='auto'")
    return None


@contextlib.contextmanager
def leased(kind: Kind[M], storage: Storage, manifest: M | None, new: Callable[[str], M],
           on_failure: Callable[[], None] | None = None) -> Iterator[tuple[Lease, M, bytes | None]]:
    """Take the lease and yield (lease, manifest, previous): the manifest `existing` returned,
    read again under the lease, with its bytes as `previous` (the fallback generation of the
    next save); or `new(name)` and None where there was none.

    The lease stays held when the body succeeds (the caller hands it to what it opens); when
    anything raises after the lease is taken, `on_failure()` runs and the lease is released."""
    if manifest is not None and kind.free is not None and live_holder(storage) is None:
        kind.free(storage, manifest)
    storage.makedirs(META_DIR)
    lease = Lease(storage)
    lease.acquire()
    try:
        remove_stale_temps(storage)
        previous = None
        if manifest is not None:
            manifest = kind.load(storage)  # again, under the lease
            previous = manifest.to_bytes()
        else:
            manifest = new(split_run_url(storage.url())[1])
        yield lease, manifest, previous
    except BaseException:
        if on_failure is not None:
            on_failure()
        lease.release()
        raise
