"""What the run manifest (`.unbroken/run.json`, manifest.py) and the sweep manifest
(`.unbroken/sweep.json`, sweep_manifest.py) have in common, written once: the bookkeeping
fields every manifest carries, and how a manifest is saved and loaded.

A manifest is saved as numbered generations: each save increments `generation`, copies the
bytes last written to the previous-generation file (`run.prev.json`, `sweep.prev.json`) and then
atomically replaces the current file. Loading takes the newest generation that parses and falls
back, with a warning, to the previous one, so a torn or corrupted write costs at most one update.

Nothing here knows what a run or a sweep is: the two modules pass in their file names, the noun
for messages and their hints. The bytes on storage are theirs to define and must not change.
"""

from __future__ import annotations

import logging
import posixpath
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

from unbroken import __version__
from unbroken.errors import CorruptRunError, RunNotFoundError, SchemaVersionError
from unbroken.store.storage import Storage

T = TypeVar("T")

log = logging.getLogger("unbroken")

META_DIR = ".unbroken"


def new_id() -> str:
    """A fresh random id: the default of a run's run_id and a sweep's sweep_id."""
    return uuid.uuid4().hex


@dataclass(kw_only=True)
class Manifest:
    """The fields every manifest carries, after the subclass's own (see `to_dict`).

    Keyword-only, so that a subclass can still declare fields without defaults (`name`).
    `schema_version` has no default here: each subclass gives it its own schema, as
    `schema_version: int = field(default=SCHEMA_VERSION, kw_only=True)`, so that a new kind
    of manifest cannot silently be written without one.
    """

    created_at: float = field(default_factory=time.time)
    updated_at: float = 0.0  # time of the last save
    generation: int = 0      # incremented by each save
    schema_version: int
    package_version: str = __version__  # the unbroken that wrote it, for the newer-schema error

    def to_dict(self) -> dict[str, Any]:
        """The manifest as JSON-ready data, the subclass's fields first and these last.

        That is the key order the files had before this base existed (the fields were declared
        last in each manifest), and it matters: sweep.json is not written with sort_keys.
        """
        raw = asdict(self)
        common = [f.name for f in fields(Manifest)]
        out = {k: v for k, v in raw.items() if k not in common}
        out.update((k, raw[k]) for k in common)
        return out

    def to_bytes(self) -> bytes:
        """The manifest file's contents; each kind of manifest chooses its JSON layout."""
        raise NotImplementedError


def known_fields(cls: type, raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` restricted to the fields of dataclass `cls`, so that a file written by a newer
    unbroken (same schema, an added optional field) still loads."""
    known = {f.name for f in fields(cls)}
    return {k: v for k, v in raw.items() if k in known}


def versioned_fields(raw: Any, cls: type, schema: int, where: str, what: str) -> dict[str, Any]:
    """`raw` (a parsed manifest) restricted to the fields `cls` knows; SchemaVersionError when a
    newer unbroken wrote it, ValueError when it is not a JSON object."""
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    version = raw.get("schema_version")
    if isinstance(version, int) and version > schema:
        raise SchemaVersionError(
            f"{where} was written with {what} schema {version} (unbroken "
            f"{raw.get('package_version', '?')}); this unbroken {__version__} reads up to "
            f"schema {schema}. Hint: upgrade unbroken (pip install -U unbroken)")
    return known_fields(cls, raw)


def remove_stale_temps(storage: Storage) -> None:
    """Remove the atomic-write temps a killed driver left in a run or sweep directory and its
    metadata directory. Call right after taking the lease, before writing anything."""
    for where in ("", META_DIR, f"{META_DIR}/validations"):
        storage.remove_stale_temps(where)


def has_generation(storage: Storage, rels: tuple[str, str]) -> bool:
    """Whether either generation file (`rels` = current, previous) exists."""
    return storage.exists(rels[0]) or storage.exists(rels[1])


def read_newest(storage: Storage, rels: tuple[str, str], parse: Callable[[bytes, str], T],
                what: str) -> tuple[T | None, list[str]]:
    """The newest generation that parses (`rels` = current, previous), with a warning when it
    had to fall back, and the problems found; (None, problems) when neither parses."""
    where = storage.url()
    problems: list[str] = []
    for rel in rels:
        try:
            manifest = parse(storage.read_bytes(rel), where)
        except FileNotFoundError:
            problems.append(f"{rel} is missing")
            continue
        except SchemaVersionError:
            raise
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as e:
            problems.append(f"{rel} is corrupted ({type(e).__name__}: {e})")
            continue
        if problems:
            log.warning("%s %s: %s; using the previous generation (%d) from %s",
                        what, where, "; ".join(problems), manifest.generation, rel)
        return manifest, problems
    return None, problems


def load_newest(storage: Storage, rels: tuple[str, str], parse: Callable[[bytes, str], T], what: str,
                *, missing_hint: str, not_a_dir: type[Exception],
                none_here: Callable[[Storage], Exception], untouched: str) -> T:
    """The newest valid generation of the manifest at `storage` (`rels` = current, previous).

    Raises, in the words of `what` ("run", "sweep"): RunNotFoundError when the path does not
    exist (with `missing_hint`); `not_a_dir` when it is a file; `none_here(storage)` when the
    directory has neither file; CorruptRunError when neither parses (noting what is `untouched`);
    SchemaVersionError when a newer unbroken wrote it.
    """
    where = storage.url()
    if not storage.exists():
        raise RunNotFoundError(f"no {what} at {where!r}: the path does not exist. Hint: {missing_hint}")
    if not storage.isdir():
        raise not_a_dir(f"{where!r} is a file, not a {what} directory. "
                        f"Hint: pass the {what}'s directory, <storage_path>/<name>")
    manifest, problems = read_newest(storage, rels, parse, what)
    if manifest is not None:
        return manifest
    if all(p.endswith("is missing") for p in problems):
        raise none_here(storage)
    raise CorruptRunError(f"{what} {where!r} cannot be read: {'; '.join(problems)}. Hint: restore "
                          f"{posixpath.basename(rels[0])} from a backup; {untouched}")


def write_generation(storage: Storage, rels: tuple[str, str], manifest: Manifest,
                     previous: bytes | None) -> bytes:
    """Write `manifest` as a new generation to rels[0]; `previous` (the bytes last written)
    goes to rels[1] first, as the fallback. Returns the bytes written."""
    manifest.generation += 1
    manifest.updated_at = time.time()
    data = manifest.to_bytes()
    if previous is not None:
        storage.write_atomic(rels[1], previous)
    storage.write_atomic(rels[0], data)
    return data
