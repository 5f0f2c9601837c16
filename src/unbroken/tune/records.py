"""What the schedulers' records on disk share (ASHA, population-based training, HyperBand):
reading a record that may not be there yet, and telling a usable number from the rest."""

from __future__ import annotations

import json
import math
from typing import Any

from unbroken.store.storage import Storage


def read_record(storage: Storage, rel: str) -> Any:
    """The JSON record at `rel`, or None when it is not there (or not whole)."""
    try:
        return json.loads(storage.read_bytes(rel))
    except (FileNotFoundError, ValueError):
        return None


def finite_number(value: Any) -> bool:
    """An int or float (not a bool) that is finite: a value a scheduler can rank."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
