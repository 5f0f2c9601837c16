"""Metric history: `result.json` (one JSON line per report, tagged with its attempt) and
`progress.csv` (the same rows as a table).

Rows are never deleted. When an attempt resumes from iteration k, the rows an earlier
attempt wrote after k stay on disk but leave the timeline, so `timeline()` has each
iteration exactly once.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
from typing import Any

from unbroken.errors import MetricsNotSerializableError
from unbroken.store.appender import Appender, open_appender
from unbroken.store.storage import Storage

log = logging.getLogger("unbroken")

RESULT_JSON = "result.json"
PROGRESS_CSV = "progress.csv"


def check_json_metrics(metrics: Any) -> None:
    """Raise TypeError naming the offending key if `metrics` cannot be recorded as JSON."""
    if not isinstance(metrics, dict):
        raise TypeError(f"train.report(metrics) needs a dict, got {type(metrics).__name__}")
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise TypeError(f"metric names must be strings, got {key!r}")
        try:
            json.dumps(value, allow_nan=True)
        except (TypeError, ValueError):
            raise MetricsNotSerializableError(
                f"metric {key!r} = {value!r} ({type(value).__name__}) is not JSON-serializable. "
                "Hint: report plain numbers, e.g. loss.item() instead of a tensor") from None


def _sanitize(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value


class History:
    """Appends rows to result.json and reads them back as one timeline."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._file: Appender | None = None
        self._rows: list[dict] | None = None

    def open(self) -> None:
        """Load existing rows, then open result.json for appending."""
        rows = self._rows = read_rows(self.storage)
        self._file = open_appender(self.storage, RESULT_JSON, initial=lambda: _lines(rows))

    def append(self, row: dict) -> None:
        assert self._rows is not None and self._file is not None, "History.open() first"
        self._file.append(_lines([row]))
        self._rows.append(row)

    def sync(self) -> None:
        """Make every appended row durable (before a checkpoint commits, and at attempt end)."""
        assert self._file is not None, "History.open() first"
        self._file.sync()

    def close(self) -> None:
        if self._file is not None:
            self.sync()
            write_progress_csv(self.storage, self._rows or [])
            self._file.close()
            self._file = None

    @property
    def rows(self) -> list[dict]:
        return list(self._rows or [])


def _lines(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, default=repr) + "\n" for r in rows).encode()


def read_rows(storage: Storage) -> list[dict]:
    """Every row on disk, in write order. A torn last line (a crash mid-write) is skipped."""
    try:
        data = storage.read_bytes(RESULT_JSON).decode("utf-8", errors="replace")
    except FileNotFoundError:
        return []
    rows = []
    lines = data.splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            if i != len(lines) - 1:
                log.warning("%s: skipping unreadable line %d of %s", storage.url(), i + 1, RESULT_JSON)
    return rows


def timeline(rows: list[dict]) -> list[dict]:
    """Each iteration once: a new attempt's first row drops rows at or after its iteration."""
    kept: list[dict] = []
    attempt = None
    for row in rows:
        if row.get("attempt") != attempt:
            attempt = row.get("attempt")
            it = row.get("training_iteration", 0)
            while kept and kept[-1].get("training_iteration", 0) >= it:
                kept.pop()
        kept.append(row)
    return kept


def to_dataframe(rows: list[dict]):
    import pandas as pd

    return pd.DataFrame(rows)


def write_progress_csv(storage: Storage, rows: list[dict]) -> None:
    """All rows (abandoned ones included, with their attempt) as a table; columns in first-seen order."""
    if not rows:
        return
    columns = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: _sanitize(v) for k, v in r.items()} for r in rows)
    storage.write_atomic(PROGRESS_CSV, buf.getvalue().encode())
