"""Metric history: `result.json` (one JSON line per report, tagged with its attempt) and
`progress.csv` (the same rows as a table).

Rows are never deleted. When an attempt resumes from iteration k, the rows an earlier
attempt wrote after k stay on disk but leave the timeline, so `timeline()` has each
iteration exactly once.

What a driver does per report, per sync and when it opens or closes a run costs the same
however long the history is: it appends (on object stores, a part per sync; see
store.appender), reads only the end of the files, and extends progress.csv with its own
rows, except on object stores, where progress.csv is rewritten once per fit()
(docs/guarantees.md has the figures).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import numbers
import os
from typing import Any

from unbroken.errors import MetricsNotSerializableError
from unbroken.store.appender import Appender, open_appender, read_tail, read_whole
from unbroken.store.storage import Storage

log = logging.getLogger("unbroken")

RESULT_JSON = "result.json"
PROGRESS_CSV = "progress.csv"
_TAIL_BYTES = 64 << 10  # how much of a file's end is read to find its last line


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


def recordable(metrics: Any, in_trial: bool) -> dict[str, Any]:
    """What a report records: in a sweep's trial (`in_trial`), values JSON cannot hold as Tune
    records them (`as_tune_records`); elsewhere such a value is a MetricsNotSerializableError."""
    if in_trial:
        return as_tune_records(metrics)
    check_json_metrics(metrics)
    return metrics


def as_tune_records(metrics: Any) -> dict[str, Any]:
    """`metrics` as a sweep's trial records them, as Ray Tune does: a value JSON cannot hold is
    not an error; numpy and torch numbers and arrays become numbers and lists, anything else
    its string (`str(value)`), nested values too."""
    if not isinstance(metrics, dict):
        raise TypeError(f"train.report(metrics) needs a dict, got {type(metrics).__name__}")
    out = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise TypeError(f"metric names must be strings, got {key!r}")
        try:
            json.dumps(value, allow_nan=True)
            out[key] = value
        except (TypeError, ValueError):
            out[key] = json.loads(json.dumps(value, allow_nan=True, default=_tune_fallback))
    return out


def _tune_fallback(value: Any) -> Any:
    if callable(getattr(value, "tolist", None)):  # numpy and torch arrays and scalars
        try:
            return value.tolist()
        except Exception:  # anything that fails is recorded as its string
            return str(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Number):
        return float(value) if isinstance(value, numbers.Real) else str(value)
    return str(value)


def _sanitize(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value


class History:
    """Appends rows to result.json (and, at close, to progress.csv), reading neither whole."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._file: Appender | None = None
        self._before: dict | None = None  # the last row on disk when the history was opened
        self._new: list[dict] = []        # the rows appended since
        self.opened = False

    def open(self) -> None:
        """Open result.json for appending; only its last row is read."""
        self._before = last_row(self.storage)
        self._file = open_appender(self.storage, RESULT_JSON)
        self.opened = True

    def append(self, row: dict) -> None:
        assert self._file is not None, "History.open() first"
        self._file.append(_lines([row]))
        self._new.append(row)

    @property
    def last(self) -> dict | None:
        """The newest row, this driver's or the one it found on disk."""
        return self._new[-1] if self._new else self._before

    def sync(self) -> None:
        """Make every appended row durable (before a checkpoint commits, and at attempt end)."""
        assert self._file is not None, "History.open() first"
        self._file.sync()

    def close(self) -> None:
        if self._file is not None:
            self.sync()
            update_progress_csv(self.storage, self._before, self._new)
            self._file.close()
            self._file = None


def _lines(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, default=repr) + "\n" for r in rows).encode()


def last_row(storage: Storage) -> dict[str, Any] | None:
    """The last metric row (always on the timeline), read from the end of result.json."""
    tail = read_tail(storage, RESULT_JSON, _TAIL_BYTES)
    if tail is None:
        return None
    data, more = tail
    for line in reversed(data.splitlines()):
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a torn last line, or the cut first line of the window
        if isinstance(row, dict):
            return row
    if not more:
        return None
    rows = read_rows(storage)  # a last line longer than the window
    return rows[-1] if rows else None


def read_rows(storage: Storage) -> list[dict]:
    """Every row on disk, in write order. A torn last line (a crash mid-write) is skipped."""
    data = read_whole(storage, RESULT_JSON).decode("utf-8", errors="replace")
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


def update_progress_csv(storage: Storage, before: dict | None, new: list[dict]) -> None:
    """Bring progress.csv up to date with result.json: on local disk, when it ends with the row
    `before` and its header has every column of the `new` rows, by appending them; otherwise
    (object stores, new columns, a file behind or torn) by rewriting it from every row."""
    if not new and before is None:
        return
    header, last = _csv_ends(storage)
    current = header is not None and (before is None and last is None or (
        before is not None and last is not None and last.get("timestamp") == str(before.get("timestamp"))))
    if current and not new:
        return
    if current and storage.is_local and all(k in header for r in new for k in r):
        buf = io.StringIO()
        csv.DictWriter(buf, fieldnames=header, lineterminator="\n").writerows(_sanitized(new))
        with open(storage.local_path(PROGRESS_CSV), "ab") as f:
            f.write(buf.getvalue().encode())
            f.flush()
            os.fsync(f.fileno())
        return
    write_progress_csv(storage, read_rows(storage))


def _csv_ends(storage: Storage) -> tuple[list[str] | None, dict[str, str] | None]:
    """progress.csv's header and its last row (None where there is none or it does not read)."""
    try:
        with storage.open_read(PROGRESS_CSV) as f:
            first = f.readline().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None, None
    header = next(csv.reader([first]), None)
    tail = (read_tail(storage, PROGRESS_CSV, _TAIL_BYTES) or (b"", False))[0]
    if not header or not tail.endswith(b"\n"):
        return None, None
    line = tail[:-1].rsplit(b"\n", 1)[-1].decode("utf-8", errors="replace")
    if line == first.rstrip("\n"):
        return header, None
    values = next(csv.reader([line]), [])
    return (header, dict(zip(header, values, strict=True))) if len(values) == len(header) else (None, None)


def _sanitized(rows: list[dict]) -> Any:
    return ({k: _sanitize(v) for k, v in r.items()} for r in rows)


def write_progress_csv(storage: Storage, rows: list[dict]) -> None:
    """All rows (abandoned ones included, with their attempt) as a table; columns in first-seen order."""
    if not rows:
        return
    columns = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(_sanitized(rows))
    storage.write_atomic(PROGRESS_CSV, buf.getvalue().encode())
