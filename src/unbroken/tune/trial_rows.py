"""The sweep driver's view of its trials' results as they come: the new rows of each trial's
history, read from storage (a trial's driver writes them; it may run on another machine).

A `RowFeed` hands each iteration of each trial once per driver (the trial's timeline: a row
redone after a failure replaces the one it redoes only if it was not handed out yet), all
trials' new rows together in the order of their timestamps. A new driver (a restore) starts
from the first row, so what is built from the rows (a stopper's state) is built again; what
must not see a row twice (a callback) keeps its own mark (`TrialRecord.results_seen`).
"""

from __future__ import annotations

import time
from typing import Any

from unbroken.store import history
from unbroken.store.storage import Storage

READ_EVERY_S = 0.5  # how often the sweep driver reads the running trials' new rows


class RowFeed:
    """New rows of the sweep's trials, read at most every READ_EVERY_S (or when asked to)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._read: dict[str, int] = {}  # by trial: the last iteration handed out
        self._read_at = -READ_EVERY_S
        self._whole: set[str] = set()  # ended trials whose every row was handed out

    def poll(self, trials: dict[str, str], ended: set[str], now: bool = False) -> list[tuple[str, str, dict]]:
        """(name, trial_id, row) for each row of `trials` ({name: trial_id}: those that have
        run) not handed out yet, oldest first; `ended`: those that will write no more rows.
        Nothing unless READ_EVERY_S passed since the last read, or `now`."""
        if not now and time.monotonic() - self._read_at < READ_EVERY_S:
            return []
        self._read_at = time.monotonic()
        new: list[tuple[Any, str, str, dict]] = []
        for name, trial_id in trials.items():
            if name in self._whole:
                continue
            for row in history.timeline(history.read_rows(self.storage.child(name))):
                it = row.get("training_iteration")
                if isinstance(it, int) and it > self._read.get(name, 0):
                    new.append((row.get("timestamp") or 0.0, name, trial_id, row))
            if name in ended:
                self._whole.add(name)
        new.sort(key=lambda item: (item[0], item[1], item[3]["training_iteration"]))
        for _, name, _, row in new:
            self._read[name] = row["training_iteration"]
        return [(name, trial_id, row) for _, name, trial_id, row in new]
