"""The checkpoint manager: which committed checkpoints a run has, which one to resume
from, which ones retention deletes, and where their validations stand. The commit protocol
itself is in `commit`; a validation's record in `validation_record`."""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

from unbroken.core.config import CheckpointConfig
from unbroken.errors import CorruptRunError, TornCheckpointError
from unbroken.store import commit, validation_record
from unbroken.store.commit import FileEntry, Marker
from unbroken.store.storage import Storage
from unbroken.store.validation_record import ValidationRecord

log = logging.getLogger("unbroken")


class CheckpointManager:
    """Bookkeeping for one run directory's checkpoints (driver side)."""

    def __init__(self, storage: Storage, config: CheckpointConfig) -> None:
        self.storage = storage
        self.config = config
        self.committed: list[Marker] = []  # in report (iteration) order
        self.validations: dict[str, ValidationRecord] = {}  # by checkpoint name, once ended

    def recover(self, full_verify: bool | None = None) -> Marker | None:
        """Find the newest checkpoint that verifies and return its marker.

        Torn or corrupted newer checkpoints are set aside (renamed `*.corrupt-N`, never
        deleted) with a warning naming them; uncommitted leftovers are removed. When the run
        has checkpoints but none verifies, raise CorruptRunError and change nothing: starting
        over from iteration 0 is for the user to decide, not a silent fallback.
        """
        names, leftovers = commit.scan(self.storage)
        for name in leftovers:
            self.storage.remove(name)
        latest: Marker | None = None
        bad: list[tuple[str, TornCheckpointError]] = []
        for name in reversed(names):
            try:
                latest = commit.verify(self.storage, name, full_verify)
                break
            except TornCheckpointError as e:
                bad.append((name, e))
        damaged = [(name, e) for name, e in bad if not self._uncommitted_upload(name)]
        if latest is None and damaged:
            details = "; ".join(str(e) for _, e in damaged)
            raise CorruptRunError(
                f"no checkpoint of run {self.storage.url()!r} verifies ({details}); nothing was changed. "
                "Hint: `unbroken verify PATH` shows each file; restore the damaged checkpoint from a "
                "backup, or move it out of the run directory to let the run start over from the "
                "newest checkpoint that remains (or from the beginning)")
        for name, e in bad:
            self._set_aside(name, e)
        self.committed = [latest] if latest else []
        for name in reversed(names[: names.index(latest.name)] if latest else []):
            try:
                self.committed.insert(0, commit.read_marker(self.storage, name))
            except TornCheckpointError as e:
                self._set_aside(name, e)
        self.validations = validation_record.read_all(self.storage, self.committed)
        return latest

    def _uncommitted_upload(self, name: str) -> bool:
        """Where checkpoints are staged in place (object stores), an unmarked directory is an
        upload that never committed."""
        return not self.storage.renames_atomically and not self.storage.exists(f"{name}/{commit.MARKER}")

    def _set_aside(self, name: str, reason: Exception) -> None:
        if self._uncommitted_upload(name):
            log.warning("removing uncommitted checkpoint directory %s (%s)", self.storage.url(name), reason)
            self.storage.remove(name)
            return
        n = 0
        while self.storage.exists(f"{name}.corrupt-{n}"):
            n += 1
        aside = f"{name}.corrupt-{n}"
        validation_record.remove(self.storage, name)  # the name may be committed again
        log.warning("checkpoint %s is torn or corrupted (%s); skipping it and resuming from the "
                    "previous one. It is kept as %s", self.storage.url(name), reason, aside)
        self.storage.rename(name, aside)

    @property
    def latest(self) -> Marker | None:
        return self.committed[-1] if self.committed else None

    def commit(self, iteration: int, attempt: int, per_rank_files: list[list[FileEntry]],
               metrics: dict[str, Any], name: str | None = None,
               validation: dict[str, Any] | None = None) -> Marker:
        """Commit the checkpoint the ranks staged for `iteration` (as `name`, a custom
        checkpoint_dir_name, which must be free), asking for `validation` if given, then
        apply retention."""
        if name is not None and name != commit.checkpoint_name(iteration):
            commit.check_name_free(self.storage, name)
        marker = Marker(name=name or commit.checkpoint_name(iteration), iteration=iteration,
                        attempt=attempt, files=commit.merge_rank_files(per_rank_files), metrics=metrics,
                        committed_at=time.time(), validation=validation)
        if validation is not None:
            validation_record.remove(self.storage, marker.name)  # an earlier checkpoint's of that name
        commit.commit(self.storage, commit.staging_name(iteration, attempt, self.storage, name), marker)
        # In report order: an asynchronous save may commit after a later synchronous one.
        bisect.insort(self.committed, marker, key=lambda m: m.iteration)
        self.retain()
        return marker

    def metrics(self, marker: Marker) -> dict[str, Any]:
        """The checkpoint's metrics: its row, with what its validation returned over it."""
        return validation_record.metrics(marker, self.validations.get(marker.name))

    def status(self, marker: Marker) -> str:
        """COMMITTED, PENDING_VALIDATION, VALIDATED, VALIDATION_FAILED or VALIDATION_TIMEOUT."""
        return validation_record.status(marker, self.validations.get(marker.name))

    def pending(self) -> list[Marker]:
        """The committed checkpoints whose validation has not ended, oldest first."""
        return [m for m in self.committed if self.status(m) == validation_record.PENDING_VALIDATION]

    def record_validation(self, name: str, record: ValidationRecord) -> None:
        """Store how checkpoint `name`'s validation ended, then apply retention (its metrics
        may rank it differently now, and it may be deleted now that it is no longer pending)."""
        if not any(m.name == name for m in self.committed):
            return  # set aside as torn meanwhile
        validation_record.write(self.storage, name, record)
        self.validations[name] = record
        self.retain()

    def _score(self, marker: Marker) -> float | None:
        attr = self.config.checkpoint_score_attribute
        value = self.metrics(marker).get(attr) if attr else None
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    def best(self) -> list[Marker]:
        """Committed checkpoints, best first by the score attribute (the latest reported first
        without one, as Ray orders them, whatever order they committed in)."""
        if not self.config.checkpoint_score_attribute:
            return list(reversed(self.committed))
        sign = 1 if self.config.checkpoint_score_order == "max" else -1
        scored = [m for m in self.committed if self._score(m) is not None]
        return sorted(scored, key=lambda m: (sign * self._score(m), m.iteration), reverse=True)

    def retain(self) -> None:
        """Delete what `num_to_keep` no longer keeps (never the latest, never one whose
        validation is pending); also at an attempt's start, so that a restore with a smaller
        num_to_keep makes room before its first commit."""
        keep_n = self.config.num_to_keep
        if keep_n is None or len(self.committed) <= keep_n:
            return
        keep = {m.name for m in self.best()[:keep_n]} | {self.committed[-1].name}
        keep |= {m.name for m in self.pending()}
        for marker in [m for m in self.committed if m.name not in keep]:
            if marker.name in self.validations:  # first: a record must never outlive its checkpoint
                validation_record.remove(self.storage, marker.name)
                del self.validations[marker.name]
            commit.uncommit_and_delete(self.storage, marker.name)
            self.committed.remove(marker)
