"""What the schedulers' records on disk share (ASHA, population-based training, HyperBand):
reading a record that may not be there yet, telling a usable number from the rest, and the
row a trial's run stands at once resumed."""

from __future__ import annotations

import json
import math
from typing import Any

from unbroken.errors import TornCheckpointError
from unbroken.store import commit, history
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


def last_kept_row(run: Storage) -> dict[str, Any]:
    """The last row of a trial's run that its next attempt keeps, or {} when there is none.
    A row naming a checkpoint that did not commit (its driver died in between) is redone when
    the trial runs again, so a scheduler catching up must not act on it."""
    rows = history.timeline(history.read_rows(run))
    if not rows:
        return {}
    name = rows[-1].get("checkpoint_dir_name")
    if name:
        try:
            commit.read_marker(run, name)
        except TornCheckpointError:
            return {}
    return rows[-1]
