"""Asynchronous checkpoint saves: the report returns, the files are written in the background,
and the checkpoint commits only once every rank's files are durable.

The protocol, for report N that carries an asynchronous save:

1. Snapshot (worker, in the report): what the save needs is made independent of the
   training that follows (TrainState copies its state to CPU memory; a reported directory is
   taken over as it is). Then the rank sends `Report(N, pending=True)` and returns to training.
2. Write (worker, background thread): the files go into checkpoint N's staging area and are
   made durable exactly as a synchronous report stages them (`commit.write_rank_files`, with
   its fault points); then the rank sends `Staged(N, files)`.
3. Record (driver): when round N is complete its metric row is written at once, naming the
   checkpoint it will have, and the reply lets every rank go on. The checkpoint is not the
   latest yet: nothing reads it, retention does not see it, a restore ignores its staging.
4. Commit (driver): when every rank with a pending save has sent `Staged(N)`, the driver
   commits checkpoint N through `commit.commit` (marker last) and tells the running ranks
   `Committed(N)`. Only now is it the latest checkpoint.

One save in flight per rank: a rank starting save N+k first waits for save N to be durable,
at the same report on every rank (every rank attaches the checkpoint to the same report), so
no rank decides alone and no collective is left waiting. A rank whose loop ends (normally,
on a stop, or with an error) waits for its save before it says `Done` or `Failed`, so a
preemption or a failing rank still commits the save in flight. A rank killed while writing
leaves the staging area unmarked: the previous committed checkpoint stays the resume point,
and the next attempt removes the leftover.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from unbroken.errors import CheckpointChangedError
from unbroken.store.commit import FileEntry, Marker, write_rank_files
from unbroken.store.storage import Storage
from unbroken.worker.protocol import Staged


# -- worker side ---------------------------------------------------------------------------------
class BackgroundSave:
    """This rank's asynchronous save in flight (at most one), written by a thread of its own."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def writing(self) -> bool:
        """True while the save's thread is still at work."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, job: Callable[[], None]) -> None:
        """Wait for the save in flight (raising its error), then run `job` in the background."""
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(job,), name="unbroken-save", daemon=True)
        self._thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as e:  # noqa: BLE001 - raised in the training thread by `wait`/`check`
            self._error = e

    def wait(self) -> None:
        """Block until the save in flight (if any) ended; raise its error, once."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()

    def check(self) -> None:
        """Raise the error of a save that failed, without waiting for one in flight."""
        error, self._error = self._error, None
        if error is not None:
            raise error


def stage_job(storage: Storage, staging: str, iteration: int, rank: int,
              produce: Callable[[], tuple[str, bool]], send: Callable[[Any], None],
              guard: Callable[[], None] | None = None) -> Callable[[], None]:
    """Step 2 as a job for `BackgroundSave.start`: `produce()` returns the local directory of
    this rank's files (and whether to delete it afterwards); they are staged (`guard` as in
    `write_rank_files`) and `Staged` sent."""
    def job() -> None:
        directory, delete = produce()
        try:
            files = write_rank_files(storage, staging, directory, rank, guard=guard)
            if not os.path.isdir(directory):  # removed before it was read: nothing was staged from it
                raise _changed(directory, rank, iteration, "it no longer exists")
        except FileNotFoundError as e:
            raise _changed(directory, rank, iteration, str(e)) from e
        finally:
            if delete:
                shutil.rmtree(directory, ignore_errors=True)
        send(Staged(iteration, files))
    return job


def _changed(directory: str, rank: int, iteration: int, what: str) -> CheckpointChangedError:
    return CheckpointChangedError(
        f"rank {rank}'s checkpoint directory {directory}, reported for checkpoint {iteration} with an "
        f"asynchronous save, changed before its files were staged ({what}). Hint: leave the directory "
        "as it is until the next checkpoint report, or report it with "
        "delete_local_checkpoint_after_upload=True, which moves it aside at once")


# -- driver side -------------------------------------------------------------------------------
@dataclass
class PendingCommit:
    """A recorded round whose checkpoint waits for ranks' background writes (step 4)."""

    iteration: int
    name: str | None                # the checkpoint directory name the ranks gave, if any
    row: dict[str, Any]             # the round's metric row, as recorded
    metrics: list[dict[str, Any]]   # what each rank reported, in rank order
    files: dict[int, list[FileEntry]] = field(default_factory=dict)  # by rank, as they arrive
    waiting: set[int] = field(default_factory=set)                   # ranks whose Staged is due
    marker: Marker | None = None    # once committed
    settled: bool = False           # committed, or never will be in this attempt
    validation: dict[str, Any] | None = None  # the validation the round's report asks for

    def per_rank_files(self) -> list[list[FileEntry]]:
        return [self.files[r] for r in sorted(self.files)]


class PendingCommits:
    """The driver's asynchronous saves that are recorded but not yet committed (one attempt),
    and the rounds' `reported` calls, kept in round order behind a save that is not settled
    (callbacks see each round once, with its committed checkpoint, in order)."""

    def __init__(self, reported: Callable[[list[dict[str, Any]], Marker | None], None]) -> None:
        self.pending: dict[int, PendingCommit] = {}
        self._early: dict[int, dict[int, list[FileEntry]]] = {}  # Staged before its round completed
        self._reported = reported
        self._rounds: deque[PendingCommit] = deque()

    def round(self, commit: PendingCommit) -> PendingCommit | None:
        """Round `commit.iteration` is recorded: settled already (no save pending; its
        `marker` if it committed one), or waiting for `commit.waiting`. Returns it when the
        files it waits for are all durable already (a rank's `Staged` may arrive before
        another rank's report completes the round)."""
        asynchronous = bool(commit.waiting)
        for rank, files in self._early.pop(commit.iteration, {}).items():
            commit.files[rank] = files
            commit.waiting.discard(rank)
        self._rounds.append(commit)
        if not asynchronous:
            commit.settled = True
            self._flush()
        elif commit.waiting:
            self.pending[commit.iteration] = commit
        else:
            return commit
        return None

    def staged(self, rank: int, message: Staged) -> PendingCommit | None:
        """Take one rank's `Staged`; returns the save once every rank's files are durable."""
        commit = self.pending.get(message.iteration)
        if commit is None:
            self._early.setdefault(message.iteration, {})[rank] = message.files
            return None
        commit.files[rank] = message.files
        commit.waiting.discard(rank)
        return None if commit.waiting else self.pending.pop(message.iteration)

    def committed(self, commit: PendingCommit, marker: Marker) -> None:
        commit.marker, commit.settled = marker, True
        self._flush()

    def can_complete(self, gone: set[int]) -> bool:
        """True while a pending save can still commit: no rank it waits for is gone."""
        return any(not commit.waiting & gone for commit in self.pending.values())

    def close(self) -> None:
        """The attempt ended: saves still pending never commit; report every round left."""
        self.pending.clear()
        for commit in self._rounds:
            commit.settled = True
        self._flush()

    def _flush(self) -> None:
        while self._rounds and self._rounds[0].settled:
            commit = self._rounds.popleft()
            self._reported(commit.metrics, commit.marker)
