"""The run directory: one place that persists a run's manifest, attempts, metric rows
and checkpoints, while its driver holds the lease."""

from __future__ import annotations

import logging
import secrets
import time
import traceback
from typing import Any

from unbroken.core.config import CheckpointConfig, stop_met_at_resume
from unbroken.errors import TornCheckpointError
from unbroken.run.callbacks import CallbackList
from unbroken.run.stragglers import Stragglers
from unbroken.store import commit
from unbroken.store import manifest as mf
from unbroken.store.checkpoint_manager import CheckpointManager
from unbroken.store.commit import FileEntry, Marker
from unbroken.store.history import History
from unbroken.store.lease import Lease
from unbroken.store.manifest import Attempt, RunManifest
from unbroken.store.storage import Storage
from unbroken.store.validation_record import ValidationRecord

log = logging.getLogger("unbroken")

ERROR_TXT = "error.txt"


class Run:
    """A run directory opened for writing by the driver that holds its lease."""

    def __init__(self, storage: Storage, manifest: RunManifest, previous: bytes | None,
                 lease: Lease, checkpoint_config: CheckpointConfig) -> None:
        self.storage = storage
        self.manifest = manifest
        self._previous = previous
        self.lease = lease
        self.checkpoints = CheckpointManager(storage, checkpoint_config)
        self.history = History(storage)
        self.attempt: Attempt | None = None
        self._attempt_t0 = 0.0
        self._time_base = 0.0
        self._last_report_t = 0.0
        self._stragglers = Stragglers()
        self.callbacks = CallbackList()  # the trainer sets RunConfig.callbacks and the progress display
        # How this fit() changed the run's identity (recorded with its first attempt), or None.
        self.config_change: dict[str, dict[str, Any]] | None = None
        self.fit_started_at = time.time()  # the trainer sets when its fit() began

    @property
    def path(self) -> str:
        return self.storage.url()

    def save_manifest(self) -> None:
        self._previous = mf.save(self.storage, self.manifest, self._previous)

    def write_probe(self, rel: str) -> str:
        """Write a fresh random token to `rel` in the run directory; returns it (workers on
        other nodes read it back to check that they share the run's storage)."""
        token = secrets.token_hex(16)
        self.storage.write_atomic(rel, token.encode())
        return token

    # -- attempts -----------------------------------------------------------------------
    def finished_at_stop(self, stop: Any) -> bool:
        """Record the run as FINISHED, with no new attempt, when the checkpoint it would resume
        from had met `stop` (see `config.stop_met_at_resume`); whether it did. Costs a listing
        and one marker read unless it did (the resume verifies the checkpoint as usual)."""
        if stop is None:
            return False
        names, _ = commit.scan(self.storage)
        try:
            newest = commit.read_marker(self.storage, names[-1]) if names else None
        except TornCheckpointError:
            return False  # the attempt sets it aside and resumes from an earlier one
        if newest is None or not stop_met_at_resume(stop, newest.metrics):
            return False
        resume = self.checkpoints.recover()
        if resume is None or resume.name != newest.name:
            return False
        self._abort_unended()
        log.info("run %s: its checkpoint %s met RunConfig.stop; the run is finished", self.path, resume.name)
        self.finish(mf.FINISHED)
        return True

    def _abort_unended(self) -> None:
        for earlier in self.manifest.attempts:
            if earlier.status == mf.RUNNING:  # its driver died without recording an end
                earlier.status = mf.ABORTED
                earlier.error = earlier.error or "the driver stopped without recording an end (killed?)"

    def begin_attempt(self, num_workers: int, elastic: dict[str, Any] | None = None,
                      in_place: dict[str, Any] | None = None) -> Marker | None:
        """Start a new attempt from the newest committed checkpoint; returns its marker.
        `elastic`: why an elastic run's attempt has this size (Attempt.elastic). `in_place`:
        the attempt recovers in place from the state of round `in_place["iteration"]`, which
        a rank holds (Attempt.in_place), and not from the checkpoint."""
        self.lease.beat()
        resume = self.checkpoints.recover()
        self.checkpoints.retain()
        self._abort_unended()
        base = resume.metrics if resume else {}
        if in_place is not None:
            base = self.history.last or {}  # the row of the round it resumes from
        self.attempt = Attempt(number=self.manifest.attempt_count + 1, started_at=time.time(),
                               resumed_from=resume.name if resume and in_place is None else None,
                               resumed_iteration=(in_place["iteration"] if in_place is not None
                                                  else resume.iteration if resume else 0),
                               num_workers=num_workers, config_change=self.config_change, elastic=elastic,
                               in_place=in_place, fit_started_at=self.fit_started_at)
        self.config_change = None  # a restart within this fit() changes nothing more
        self.manifest.attempts.append(self.attempt)
        self.manifest.status = mf.RUNNING
        self._sync_checkpoint_fields()
        self.save_manifest()
        if not self.history.opened:  # after run.json exists: a new run's first files are in order
            self.history.open()
        self._time_base = float(base.get("time_total_s", 0.0))
        self._attempt_t0 = self._last_report_t = time.monotonic()
        self._stragglers = Stragglers()
        self.callbacks.attempt_started()
        return resume

    def end_attempt(self, status: str, error: BaseException | None = None) -> None:
        assert self.attempt is not None
        self.attempt.ended_at = time.time()
        self.attempt.status = status
        if error is not None:
            self.attempt.error = f"{type(error).__name__}: {error}".splitlines()[0][:500]
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            self.storage.write_atomic(ERROR_TXT, f"attempt {self.attempt.number}\n{text}".encode())
        self.history.sync()
        self.save_manifest()
        self.callbacks.attempt_ended(status, error)

    def finish(self, status: str) -> None:
        """Mark the whole run FINISHED, ERRORED or INTERRUPTED and release the lease.

        The rows and progress.csv are written first: once run.json says the run ended, no
        later fit() writes to it (a finished run is returned as it is), so nothing may be
        left half-written after that."""
        self.history.close()
        self.manifest.status = status
        self._sync_checkpoint_fields()
        self.save_manifest()
        self.callbacks.run_ended(status)
        self.lease.release()

    # -- reports ------------------------------------------------------------------------
    def row(self, iteration: int, metrics: dict[str, Any],
            forward_s: dict[int, float | None] | None = None) -> dict:
        """The row of one report round (rank 0's metrics plus the run's counters), made but not
        recorded yet: a verdict on it (`RunConfig.stop`) may decide the checkpoint it names.
        `forward_s`: each rank's forward seconds since its previous report; a rank
        consistently slower than the others is named in the row (`straggler_rank`,
        `straggler_ratio`) and the attempt (`Attempt.forward_s`)."""
        assert self.attempt is not None
        now = time.monotonic()
        row = dict(metrics)
        since_restore = now - self._attempt_t0
        row.update(training_iteration=iteration,
                   iterations_since_restore=iteration - self.attempt.resumed_iteration,
                   time_total_s=self._time_base + since_restore, time_since_restore=since_restore,
                   time_this_iter_s=now - self._last_report_t, timestamp=time.time(),
                   attempt=self.attempt.number, checkpoint_dir_name=None)
        if forward_s:
            self._stragglers.add(forward_s)
            summary = self._stragglers.summary()
            if summary is not None:
                self.attempt.forward_s = summary
                if summary["straggler"] is not None:
                    row.update(straggler_rank=summary["straggler"]["rank"],
                               straggler_ratio=summary["straggler"]["ratio"])
        self._last_report_t = now
        return row

    def record(self, row: dict, checkpoint_name: str | None, save_s: float | None = None) -> dict:
        """Append `row` (from `row()`), naming the checkpoint the round has or will have;
        `save_s`: for a round that saved a checkpoint, the longest any rank's loop was blocked
        saving it, kept in the attempt's `checkpoint_stalls`."""
        assert self.attempt is not None
        row["checkpoint_dir_name"] = checkpoint_name
        if save_s is not None:
            if self.attempt.checkpoint_stalls is None:
                self.attempt.checkpoint_stalls = {}
            self.attempt.checkpoint_stalls[str(row["training_iteration"])] = save_s
        self.history.append(row)
        self.callbacks.result(row)
        return row

    def commit_checkpoint(self, iteration: int, per_rank_files: list[list[FileEntry]],
                          row: dict, name: str | None = None,
                          validation: dict[str, Any] | None = None) -> Marker:
        assert self.attempt is not None
        self.history.sync()
        marker = self.checkpoints.commit(iteration, self.attempt.number, per_rank_files, row, name,
                                         validation)
        self._sync_checkpoint_fields()
        self.save_manifest()
        self.lease.beat()
        self.callbacks.checkpoint(marker)
        return marker

    def record_validation(self, name: str, record: ValidationRecord) -> None:
        """Checkpoint `name`'s validation ended: store it, and the best checkpoints it changes."""
        self.lease.beat()  # raises LeaseLostError, before anything is written, if the run is not ours
        self.checkpoints.record_validation(name, record)
        best = [m.name for m in self.checkpoints.best()]
        if best != self.manifest.best_checkpoints or self.manifest.latest_checkpoint != (
                self.checkpoints.latest.name if self.checkpoints.latest else None):
            self._sync_checkpoint_fields()
            self.save_manifest()

    def reported(self, metrics: list[dict[str, Any]], marker: Marker | None) -> None:
        """A report round is recorded and its checkpoint (if any) committed: `metrics` holds
        what each rank reported, in rank order (for V2's `UserCallback.after_report`)."""
        self.callbacks.reported(metrics, marker)

    def _sync_checkpoint_fields(self) -> None:
        latest = self.checkpoints.latest
        self.manifest.latest_checkpoint = latest.name if latest else None
        self.manifest.best_checkpoints = [m.name for m in self.checkpoints.best()]
