"""What the training function returned on rank 0, kept for `Result.return_value` (Ray Train V2).

Rank 0 writes it into the run's metadata when its loop returns: as JSON where the value is
plain data, else cloudpickled next to a small JSON header. The header names the attempt, so
a Result reads only the value of the attempt that finished the run, never an older one.
Reading a pickled value unpickles it, so it happens only when `Result.return_value` is
read, and only for a trusted run directory (as everything else in it).
"""

from __future__ import annotations

import json
from typing import Any

import cloudpickle

from unbroken.store.manifest import META_DIR
from unbroken.store.storage import Storage

HEADER = f"{META_DIR}/return_value.json"
PICKLE = f"{META_DIR}/return_value.pkl"


def save(storage: Storage, attempt: int, value: Any) -> None:
    """Write `value` as attempt `attempt`'s return value (TypeError if it cannot be pickled)."""
    try:
        header = json.dumps({"attempt": attempt, "value": value}, allow_nan=False).encode()
    except (TypeError, ValueError):
        storage.write_atomic(PICKLE, cloudpickle.dumps(value))
        header = json.dumps({"attempt": attempt, "pickled": True}).encode()
    storage.write_atomic(HEADER, header)


def load(storage: Storage, attempt: int) -> Any:
    """The value attempt `attempt` returned; None when it returned nothing or wrote none."""
    try:
        header = json.loads(storage.read_bytes(HEADER))
    except (FileNotFoundError, ValueError):
        return None
    if not isinstance(header, dict) or header.get("attempt") != attempt:
        return None
    if header.get("pickled"):
        return cloudpickle.loads(storage.read_bytes(PICKLE))
    return header.get("value")
