"""An Optuna study kept in the sweep directory as a journal, on any storage unbroken writes to.

Optuna's `JournalStorage` rebuilds a study from an ordered log of its operations; this is the
log's backend. Each `append_logs` call writes one new file, `.unbroken/optuna/<n>.json`, named
after the number of its first log and created only if absent (a conditional create on object
stores, an exclusive link on local disks), so an append is atomic, nothing is ever
rewritten, and a second writer could never interleave: its create would fail. Only the sweep
driver holding the sweep's lease writes (searchers run in the sweep driver). A restore on
another machine reads the study back from the files alone.

Sweeps started before the journal keep their SQLite study (`optuna.db`) on local disks.
"""

from __future__ import annotations

import json
from typing import Any

from unbroken.errors import StorageError
from unbroken.store.manifest import META_DIR
from unbroken.store.storage import CREATE, Storage
from unbroken.store.storage_errors import PreconditionFailed

JOURNAL_DIR = f"{META_DIR}/optuna"
LEGACY_DB = "optuna.db"


class SweepJournal:
    """Optuna's journal backend (`read_logs`, `append_logs`) over the sweep's storage."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._batches: dict[int, list[dict[str, Any]]] = {}  # first log number -> its logs (immutable)

    def _starts(self) -> list[int]:
        names = self.storage.listdir(JOURNAL_DIR)
        return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())

    def _batch(self, start: int) -> list[dict[str, Any]]:
        if start not in self._batches:
            self._batches[start] = json.loads(self.storage.read_bytes(f"{JOURNAL_DIR}/{start:012d}.json"))
        return self._batches[start]

    def read_logs(self, log_number_from: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        starts = self._starts()
        for start, following in zip(starts, [*starts[1:], None], strict=False):
            if following is not None and following <= log_number_from:
                continue  # every log of this batch comes before the first one asked for
            logs = self._batch(start)
            out.extend(logs[max(0, log_number_from - start):])
        return out

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        starts = self._starts()
        start = starts[-1] + len(self._batch(starts[-1])) if starts else 0
        data = json.dumps(logs, separators=(",", ":")).encode()
        try:
            self.storage.write_conditional(f"{JOURNAL_DIR}/{start:012d}.json", data, CREATE)
        except PreconditionFailed:
            raise StorageError(
                f"the Optuna study of the sweep at {self.storage.url()!r} was written by another process "
                f"at the same moment (log {start}). Hint: one driver per sweep; restore the sweep") from None
        self._batches[start] = logs


def study_storage(storage: Storage, optuna: Any) -> Any:
    """The Optuna storage of the sweep at `storage`: its journal, or the SQLite database of a
    sweep started before the journal."""
    if storage.is_local and storage.exists(LEGACY_DB) and not storage.listdir(JOURNAL_DIR):
        return f"sqlite:///{storage.path(LEGACY_DB)}"
    storage.makedirs(JOURNAL_DIR)
    backend = type("SweepJournalBackend", (SweepJournal, optuna.storages.journal.BaseJournalBackend), {})
    return optuna.storages.JournalStorage(backend(storage))
