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
from collections.abc import Callable
from typing import Any

from unbroken.errors import CheckpointChangedError
from unbroken.store.commit import check_name_free, write_rank_files
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


class AsyncSaves:
    """This rank's asynchronous saves: the one in flight (`BackgroundSave`), the latest
    started and the latest the driver said it committed, and the checkpoint names they were
    given (a later report must not reuse one before the driver committed it)."""

    def __init__(self) -> None:
        self._saver = BackgroundSave()
        self._started = 0  # the iteration of the latest save started
        self._committed = 0  # the latest one the driver said it committed
        self._names: set[str] = set()

    def check(self) -> None:
        """Raise the error of a save that failed (`BackgroundSave.check`)."""
        self._saver.check()

    def wait(self) -> None:
        """Block until the save in flight ended (`BackgroundSave.wait`)."""
        self._saver.wait()

    def check_free(self, storage: Storage, name: str) -> None:
        """CheckpointNameError when the checkpoint name `name` is taken in `storage`, or by a
        save of this rank that the driver may not have committed yet."""
        check_name_free(storage, name, self._names)

    def claim(self, storage: Storage, name: str) -> None:
        """Give the coming save the checkpoint name `name`, which must be free."""
        self.check_free(storage, name)
        self._names.add(name)

    def start(self, job: Callable[[], None], iteration: int) -> None:
        """Start `job`, the save of report `iteration` (`stage_job`), in the background."""
        self._saver.start(job)
        self._started = iteration

    def committed(self, iteration: int) -> bool:
        """The driver said it committed the save of report `iteration`: whether that is news."""
        if iteration <= self._committed:
            return False
        self._committed = iteration
        return True

    @property
    def uncommitted(self) -> bool:
        """True while the driver has not said it committed the latest save started."""
        return self._committed < self._started


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
