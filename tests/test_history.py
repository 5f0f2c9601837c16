"""The metric history's files: result.json appended to, progress.csv extended with the rows of
each fit() (rewritten whole only when it is behind or a column is new), on real files."""

from __future__ import annotations

import os

from unbroken.store.history import PROGRESS_CSV, History, last_row, read_rows, write_progress_csv
from unbroken.store.storage import Storage


def rows(first: int, last: int, attempt: int, **extra) -> list[dict]:
    return [{"loss": 1.0 / it, "training_iteration": it, "timestamp": 1000.0 + it + attempt / 10,
             "attempt": attempt, **extra} for it in range(first, last + 1)]


def fit(storage: Storage, new: list[dict], close: bool = True) -> None:
    history = History(storage)
    history.open()
    for row in new:
        history.append(row)
    history.sync()
    if close:
        history.close()


def csv_text(storage: Storage) -> str:
    return open(storage.local_path(PROGRESS_CSV)).read()


def rewritten(storage: Storage, tmp_path) -> str:
    """What progress.csv holds when written whole from result.json."""
    other = Storage.from_url(str(tmp_path / "whole"))
    other.makedirs()
    write_progress_csv(other, read_rows(storage))
    return csv_text(other)


def inode(storage: Storage) -> int:
    return os.stat(storage.local_path(PROGRESS_CSV)).st_ino


def test_progress_csv_is_extended_by_each_fit_and_rewritten_only_when_it_must(tmp_path):
    storage = Storage.from_url(str(tmp_path / "run"))
    storage.makedirs()
    fit(storage, rows(1, 3, attempt=1))
    assert csv_text(storage) == rewritten(storage, tmp_path)
    assert last_row(storage)["training_iteration"] == 3

    first = inode(storage)
    fit(storage, rows(4, 6, attempt=2))  # the same columns: appended in place
    assert inode(storage) == first, "extended, not rewritten"
    assert csv_text(storage) == rewritten(storage, tmp_path)

    fit(storage, rows(7, 8, attempt=3, accuracy=0.5))  # a new column: rewritten whole
    assert inode(storage) != first
    assert csv_text(storage) == rewritten(storage, tmp_path)
    assert csv_text(storage).splitlines()[0].endswith(",accuracy")

    fit(storage, rows(9, 10, attempt=4), close=False)  # a driver killed before it closed
    fit(storage, rows(9, 11, attempt=5))  # progress.csv is behind: rewritten whole
    assert csv_text(storage) == rewritten(storage, tmp_path)
    assert len(csv_text(storage).splitlines()) == 1 + len(read_rows(storage)) == 1 + 13

    fit(storage, [])  # nothing new: left as it is
    assert csv_text(storage) == rewritten(storage, tmp_path)


def test_a_torn_progress_csv_is_rewritten(tmp_path):
    storage = Storage.from_url(str(tmp_path / "run"))
    storage.makedirs()
    fit(storage, rows(1, 3, attempt=1))
    with open(storage.local_path(PROGRESS_CSV), "a") as f:
        f.write("0.2,4,100")  # an append cut short
    fit(storage, rows(4, 5, attempt=2))
    assert csv_text(storage) == rewritten(storage, tmp_path)
