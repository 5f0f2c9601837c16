"""The pickled arguments of a run or a sweep on storage: one file per argument, each
unpickled only when asked for, and never when unpickling is not allowed.

A run directory may come from storage others can write, and unpickling runs code. So each
pickled argument lives in its own file (`.unbroken/pickled/<name>.pkl`, its cloudpickle
bytes), reading one never touches another, and a reader that is told `allow=False` refuses
instead of unpickling. Schema 1 runs and sweeps kept them all in one pickled dict (the
"legacy" container), which has to be unpickled whole to get any one of them.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import posixpath
from collections.abc import Iterable
from typing import Any

from unbroken.core.stable_names import current_module
from unbroken.errors import PickleRefusedError
from unbroken.store.manifest import META_DIR, PICKLED_FILES_SINCE, RunManifest
from unbroken.store.storage import Storage

PICKLED_DIR = f"{META_DIR}/pickled"  # a run's: one file per pickled argument
LEGACY_TRAINER_PKL = f"{META_DIR}/trainer.pkl"  # schema 1: one pickled {name: cloudpickle bytes}

_SAFE = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_-")


def pickle_file(directory: str, name: str) -> str:
    """The file holding the pickled argument `name`: lower-case letters, digits, '_' and '-'
    are kept, every other character is %XX-escaped (UTF-8), so that two names never share a
    file, not even on a case-insensitive filesystem; a very long name is cut and hashed."""
    out = "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in name)
    if len(out) > 200:
        out = f"{out[:150]}~{hashlib.sha256(name.encode()).hexdigest()[:16]}"
    return f"{directory}/{out}.pkl"


def write_pickles(storage: Storage, directory: str, pickles: dict[str, bytes],
                  keep: Iterable[str] = ()) -> None:
    """Write each blob to its own file under `directory`, atomically, then remove the files
    there that belong neither to `pickles` nor to `keep` (the names that the manifest still on
    storage refers to, until the caller saves the new one). Only under the lease."""
    if pickles:
        storage.makedirs(directory)
    for name, blob in pickles.items():
        storage.write_atomic(pickle_file(directory, name), blob)
    wanted = {posixpath.basename(pickle_file(directory, n)) for n in [*pickles, *keep]}
    for entry in storage.listdir(directory):
        if entry.endswith(".pkl") and entry not in wanted:
            storage.remove(f"{directory}/{entry}")
    storage.remove_stale_temps(directory)


def replace_pickles(storage: Storage, schema_version: Any, directory: str, pickles: dict[str, bytes],
                    previous: Iterable[str], legacy: str | None = None) -> None:
    """Save a run's or a sweep's pickled arguments in place of the ones stored: `pickles` under
    `directory` (`write_pickles`), keeping `previous` (what the manifest still on storage, of
    `schema_version`, names) until the caller saves the new manifest, and removing the schema 1
    container `legacy` once the manifest on storage no longer needs it."""
    current = pickled_files(schema_version)
    write_pickles(storage, directory, pickles, keep=previous if current else ())
    if current and legacy is not None and storage.exists(legacy):
        storage.remove(legacy)  # left by a schema 1 run or sweep that has been rewritten since


def loads(blob: bytes) -> Any:
    """Unpickle cloudpickle bytes, with unbroken's own classes found by their stable module
    names (`core.stable_names`), so that what a run pickled before a module moved loads."""
    return _Unpickler(io.BytesIO(blob)).load()


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return super().find_class(current_module(module), name)


def pickled_files(schema_version: Any) -> bool:
    """Whether a manifest of this schema keeps its pickles one file each (else one container)."""
    return isinstance(schema_version, int) and schema_version >= PICKLED_FILES_SINCE


class SavedPickles:
    """The pickled arguments stored with a run (or a sweep), each unpickled only when asked for.

    Schema 2 and later: one file per argument under `directory`, holding its cloudpickle
    bytes. A schema 1 run kept them all in one pickled dict, `legacy`, which has to be
    unpickled whole to get at any one of them. With `allow=False` nothing is ever unpickled:
    `load` raises PickleRefusedError (restore() checks before it loads anything, so that
    the refusal lists everything to re-specify)."""

    def __init__(self, storage: Storage, directory: str, legacy: str | None = None,
                 allow: bool = True) -> None:
        self.storage, self.directory, self.legacy, self.allow = storage, directory, legacy, allow
        self._container: dict[str, bytes] | None = None

    @classmethod
    def of_run(cls, storage: Storage, manifest: RunManifest, allow: bool = True) -> SavedPickles:
        legacy = None if pickled_files(manifest.schema_version) else LEGACY_TRAINER_PKL
        return cls(storage, PICKLED_DIR, legacy, allow)

    def has(self, name: str) -> bool | None:
        """Whether `name` was stored; None when that cannot be known without unpickling."""
        return None if self.legacy is not None else self.storage.exists(pickle_file(self.directory, name))

    def load(self, name: str) -> Any:
        """Unpickle `name`; FileNotFoundError if it was not stored."""
        if not self.allow:
            raise PickleRefusedError(f"{name} would have to be unpickled, and allow_pickle=False")
        if self.legacy is None:
            return loads(self.storage.read_bytes(pickle_file(self.directory, name)))
        if self._container is None:
            self._container = pickle.loads(self.storage.read_bytes(self.legacy))
        if name not in self._container:
            raise FileNotFoundError(f"{name} is not in {self.legacy}")
        return loads(self._container[name])


def refuse_pickles(what: list[str], path: str, call: str, respecify: list[str], notes: str = "",
                   kind: str = "run") -> None:
    """PickleRefusedError listing `what` restore(allow_pickle=False) would have had to unpickle,
    raised before anything is; the hint is `call` (a restore call ending in ")") with
    `respecify` filled in, and `notes`."""
    if not what:
        return
    hints = []
    if respecify:
        args = "".join(f", {name}=..." for name in respecify)
        hints.append(f"re-specify {' and '.join(respecify)}: {call[:-1]}{args})")
    if notes:
        hints.append(notes)
    hints.append("or, only if you trust this directory, pass allow_pickle=True")
    raise PickleRefusedError(
        f"restore with allow_pickle=False refuses the {kind} at {path!r}: restoring it would unpickle "
        f"{' and '.join(what)}, and unpickling can run code. Nothing was unpickled. "
        f"Hint: {'; '.join(hints)}")
