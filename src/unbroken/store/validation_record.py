"""What became of a checkpoint's validation, stored next to the run's checkpoints.

A checkpoint asks for validation in its commit marker (`Marker.validation`), so the
request commits atomically with the checkpoint. The outcome is one small file per
checkpoint, `.unbroken/validations/<checkpoint name>.json`, written atomically once the
validation ended: {"status": VALIDATED | VALIDATION_FAILED | VALIDATION_TIMEOUT, "metrics":
{...}, "error": "...", "finished_at": t}. A checkpoint whose marker asks and that has no
file is pending: whoever drives the run next validates it (once recorded, never again).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from unbroken.store.commit import Marker
from unbroken.store.manifest_base import META_DIR
from unbroken.store.storage import Storage

DIR = f"{META_DIR}/validations"

COMMITTED = "COMMITTED"                    # no validation asked for
PENDING_VALIDATION = "PENDING_VALIDATION"  # asked for, not ended yet
VALIDATED = "VALIDATED"
VALIDATION_FAILED = "VALIDATION_FAILED"
VALIDATION_TIMEOUT = "VALIDATION_TIMEOUT"


@dataclass
class ValidationRecord:
    """How a checkpoint's validation ended."""

    status: str
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    finished_at: float = 0.0


def _rel(name: str) -> str:
    return f"{DIR}/{name}.json"


def write(storage: Storage, name: str, record: ValidationRecord) -> None:
    if storage.is_local:
        storage.makedirs(DIR)  # elsewhere the write makes what it needs
    storage.write_atomic(_rel(name), json.dumps(asdict(record), sort_keys=True, default=repr).encode())


def read(storage: Storage, name: str) -> ValidationRecord | None:
    """The record of checkpoint `name`'s validation, or None when it has none (yet)."""
    try:
        return ValidationRecord(**json.loads(storage.read_bytes(_rel(name))))
    except FileNotFoundError:
        return None


def read_all(storage: Storage, markers: list[Marker]) -> dict[str, ValidationRecord]:
    """The records of those of `markers` that asked for validation and have one."""
    out = {}
    for marker in markers:
        if marker.validation is not None:
            record = read(storage, marker.name)
            if record is not None:
                out[marker.name] = record
    return out


def remove(storage: Storage, name: str) -> None:
    """Forget checkpoint `name`'s record (its checkpoint was deleted)."""
    storage.remove(_rel(name))


def status(marker: Marker, record: ValidationRecord | None) -> str:
    if marker.validation is None:
        return COMMITTED
    return record.status if record is not None else PENDING_VALIDATION


def metrics(marker: Marker, record: ValidationRecord | None) -> dict[str, Any]:
    """The checkpoint's metrics: its report's row, with what its validation returned over it."""
    if record is None or record.status != VALIDATED:
        return marker.metrics
    return {**marker.metrics, **record.metrics}
