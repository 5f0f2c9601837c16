"""The run's committed checkpoints as `train.get_all_reported_checkpoints` lists them (Ray
Train V2's `ReportedCheckpoint`s): read from storage, each with the metrics and the status
its validation gave it, if it asked for one."""

from __future__ import annotations

from unbroken.errors import TornCheckpointError
from unbroken.store import validation_record
from unbroken.store.checkpoint import Checkpoint
from unbroken.store.commit import read_marker, scan
from unbroken.store.storage import Storage
from unbroken.worker.report_config import ReportedCheckpoint, ReportedCheckpointStatus


class CommittedCheckpoints:
    """The run's committed checkpoints in `storage`, oldest first, as they are now, with the
    validation records written so far; `validating`: the names of those whose validation has
    no record yet."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self._markers = []
        for name in scan(storage)[0]:
            try:
                self._markers.append(read_marker(storage, name))
            except TornCheckpointError:
                continue
        self._records = validation_record.read_all(storage, self._markers)
        self.validating = {m.name for m in self._markers
                           if m.validation is not None and m.name not in self._records}

    def reported(self) -> list[ReportedCheckpoint]:
        """Each checkpoint with its metrics and status; the records of those `validating` are
        read again first (a validation may have ended since)."""
        storage, records = self._storage, self._records
        validating = [m for m in self._markers if m.name in self.validating]
        records.update(validation_record.read_all(storage, validating))
        return [ReportedCheckpoint(Checkpoint(storage.url(m.name), storage.filesystem_arg),
                                   validation_record.metrics(m, records.get(m.name)),
                                   ReportedCheckpointStatus(validation_record.status(m, records.get(m.name))))
                for m in self._markers]
