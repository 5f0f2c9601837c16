"""The run manifest, `.unbroken/run.json`: what the run is and where it stands.

It is replaced atomically and carries a generation number; the previous generation is
kept in `run.prev.json` and used, with a warning, when the newest one does not load.
"""

from __future__ import annotations

import json
import logging
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

# 2: pickled arguments are one file each under .unbroken/pickled/; 1 kept them in one pickled
# dict, .unbroken/trainer.pkl (still read, see restore.SavedPickles).
SCHEMA_VERSION = 2
PICKLED_FILES_SINCE = 2
META_DIR = ".unbroken"
RUN_JSON = f"{META_DIR}/run.json"
RUN_PREV_JSON = f"{META_DIR}/run.prev.json"

RUNNING, FINISHED, ERRORED, INTERRUPTED = "RUNNING", "FINISHED", "ERRORED", "INTERRUPTED"
ABORTED = "ABORTED"  # an attempt whose driver died (e.g. SIGKILL) before it could record an end


@dataclass
class Attempt:
    """One try at the run: a fit() start or a worker-group restart."""

    number: int
    started_at: float
    resumed_from: str | None = None
    resumed_iteration: int = 0
    num_workers: int = 1
    ended_at: float | None = None
    status: str = RUNNING
    error: str | None = None
    # The identity the fit() that started this attempt changed, by key path:
    # {"train_loop_config.epochs": {"saved": 8, "now": 10}} (a side is absent where the key was).
    # Only in run.json when there is one, so that runs without changes read as before.
    config_change: dict[str, dict[str, Any]] | None = None
    # With TrainState(jit_checkpoint=True), what a failure of this attempt saved just in time:
    # {"iteration": 6, "rank": 0, "seconds": 0.05}, or {"iteration": None, "why_not": "..."}
    # (see unbroken.worker.jit). Only in run.json when there is one.
    jit_checkpoint: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Attempt:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})


def config_change_lines(change: dict[str, dict[str, Any]]) -> list[str]:
    """One line per changed key: `  key: saved X -> now Y` (values as JSON, "(absent)")."""
    def show(side: dict[str, Any], key: str) -> str:
        return json.dumps(side[key], default=repr) if key in side else "(absent)"
    return [f"  {key}: saved {show(sides, 'saved')} -> now {show(sides, 'now')}"
            for key, sides in sorted(change.items())]


@dataclass
class RunManifest:
    """Contents of run.json. Field names are the on-disk format; see docs/storage-format.md."""

    name: str
    trainer_class: str
    trainer_mro: list[str]
    params: dict[str, Any] = field(default_factory=dict)
    pickled_params: list[str] = field(default_factory=list)
    must_respecify: list[str] = field(default_factory=list)
    dataset_names: list[str] = field(default_factory=list)
    identity: dict[str, Any] = field(default_factory=dict)
    identity_fingerprint: str = ""
    code_fingerprints: dict[str, str] = field(default_factory=dict)
    status: str = RUNNING
    attempts: list[Attempt] = field(default_factory=list)
    latest_checkpoint: str | None = None
    best_checkpoints: list[str] = field(default_factory=list)
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created_at: float = field(default_factory=time.time)
    updated_at: float = 0.0
    generation: int = 0
    schema_version: int = SCHEMA_VERSION
    package_version: str = __version__

    def to_bytes(self) -> bytes:
        raw = asdict(self)
        for attempt in raw["attempts"]:
            for optional in ("config_change", "jit_checkpoint"):
                if attempt[optional] is None:
                    del attempt[optional]
        return json.dumps(raw, indent=1, sort_keys=True, default=repr).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> RunManifest:
        raw = versioned_fields(json.loads(data), cls, SCHEMA_VERSION, where, "storage")
        raw["attempts"] = [Attempt.from_dict(a) for a in raw.get("attempts", [])]
        return cls(**raw)

    @property
    def attempt_count(self) -> int:
        return len(self.attempts)


def remove_stale_temps(storage: Storage) -> None:
    """Remove the atomic-write temps a killed driver left in a run or sweep directory and its
    metadata directory. Call right after taking the lease, before writing anything."""
    for where in ("", META_DIR):
        storage.remove_stale_temps(where)


def is_run_dir(storage: Storage) -> bool:
    return storage.exists(RUN_JSON) or storage.exists(RUN_PREV_JSON)


def load(storage: Storage) -> RunManifest:
    """Load the newest valid generation; raise a specific error if none is valid."""
    where = storage.url()
    if not storage.exists():
        raise RunNotFoundError(f"no run at {where!r}: the path does not exist. "
                               "Hint: check the path; a run is <storage_path>/<name>")
    if not storage.isdir():
        raise RunNotFoundError(f"{where!r} is a file, not a run directory. "
                               "Hint: pass the run's directory, <storage_path>/<name>")
    manifest, problems = read_newest(storage, (RUN_JSON, RUN_PREV_JSON), RunManifest.from_bytes, "run")
    if manifest is not None:
        return manifest
    if all(p.endswith("is missing") for p in problems):
        raise RunNotFoundError(
            f"no run at {where!r}: it has no {RUN_JSON}. Hint: pass a run directory "
            "(<storage_path>/<name>), or start a new run there with fit()")
    raise CorruptRunError(f"run {where!r} cannot be read: {'; '.join(problems)}. Hint: restore "
                          "run.json from a backup; checkpoints in the directory are untouched")


def save(storage: Storage, manifest: RunManifest, previous: bytes | None) -> bytes:
    """Write a new generation; `previous` (the bytes last written) becomes the fallback."""
    return write_generation(storage, (RUN_JSON, RUN_PREV_JSON), manifest, previous)


# -- shared by the run manifest and the sweep manifest -------------------------------------
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
    known = {f.name for f in fields(cls)}
    return {k: v for k, v in raw.items() if k in known}


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


def write_generation(storage: Storage, rels: tuple[str, str], manifest: Any, previous: bytes | None) -> bytes:
    """Write `manifest` as a new generation to rels[0]; `previous` (the bytes last written)
    goes to rels[1] first, as the fallback. Returns the bytes written."""
    manifest.generation += 1
    manifest.updated_at = time.time()
    data = manifest.to_bytes()
    if previous is not None:
        storage.write_atomic(rels[1], previous)
    storage.write_atomic(rels[0], data)
    return data
