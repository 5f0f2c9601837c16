"""The worker side of a run: what `train.report`, `train.get_checkpoint`,
`train.get_context` and `train.get_dataset_shard` talk to inside a worker process.

`report` is collective and pipelined: a rank sends report N and continues; before
report N+1 (or a `should_checkpoint()` query) it takes the driver's reply to report N,
which the driver sends once every rank has reported N. So every rank sees the same
decisions (checkpoint now, stop) at the same report, and the report path costs one
message each way with no polling. A report with an asynchronous save writes its files in
the background (`async_save`).
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from unbroken.core import faults
from unbroken.core.codec import is_dataset_builder
from unbroken.errors import TornCheckpointError
from unbroken.store import return_value, validation_record
from unbroken.store.checkpoint import Checkpoint
from unbroken.store.commit import (
    check_name_free,
    read_marker,
    scan,
    staging_name,
    write_rank_files,
)
from unbroken.store.history import recordable
from unbroken.store.storage import Storage
from unbroken.worker.async_save import BackgroundSave, stage_job
from unbroken.worker.protocol import Committed, Failed, Gather, Gathered, Reply, Report, Staged, Validated
from unbroken.worker.report_config import ReportedCheckpoint, ReportedCheckpointStatus
from unbroken.worker.train_context import TrainContext

if TYPE_CHECKING:
    from unbroken.worker.backend import Backend
    from unbroken.worker.channel import Channel
    from unbroken.worker.jit import Tracker


log = logging.getLogger("unbroken")

NO_REPLY = Reply()


ATTEMPT_ENDED_EXIT = 75  # the exit status of a rank that finds its attempt over (check_attempt)


class StopTraining(BaseException):
    """Raised inside a worker's loop at a report when the driver stops the run.

    A BaseException so that a user's `except Exception` does not swallow it. `attach`: the
    report was made `at_end` and the driver asks for its checkpoint after all
    (`Session.attach`).
    """

    def __init__(self, attach: bool = False) -> None:
        super().__init__()
        self.attach = attach


@dataclass
class WorkerInfo:
    """Everything a worker needs to know about its place in the run."""

    world_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    experiment_name: str
    run_path: str
    storage: Storage
    attempt: int
    start_iteration: int
    checkpoint: Checkpoint | None
    storage_path: str
    cpus: int = 1
    use_gpu: bool = False
    trial_name: str | None = None
    trial_id: str | None = None
    trial_dir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    node_id: str = ""                 # the engine's name for this rank's machine
    node_address: str = "127.0.0.1"   # where the other ranks reach this rank's machine
    probe: str | None = None          # the token the driver wrote for `engine.worker` to check
    validates: bool = False           # the trainer has a ValidationConfig: validations get done
    peer_source: int | None = None    # recovering in place: the rank that sends every rank the state
    collective_timeout_s: float | None = None  # FailureConfig.collective_timeout_s


class Session:
    """One worker's connection to the driver."""

    def __init__(self, info: WorkerInfo, channel: Channel, datasets: dict[str, Any] | None) -> None:
        self.info = info
        self.channel = channel
        self.datasets = datasets or {}
        self.iteration = info.start_iteration
        self.reports = 0
        self._save_t0: float | None = None  # when the save of the coming report began
        self.auto_checkpoint = False  # TrainState.report(..., checkpoint="auto") sets it
        self.forward_clock: Any = None  # prepare_model's ForwardClock on the model it wrapped
        self.wrappers: list[Any] = []  # the DDP wrappers prepare_model made in this process
        self._awaiting_reply = False
        self._reply = NO_REPLY  # the latest reply taken (NO_REPLY between a report and its reply)
        self._verdict_at: int | None = None  # from the latest reply taken (Reply.verdict_at)
        self.context = TrainContext(self)
        self.jit: Tracker | None = None  # a TrainState that can save just in time (`jit_checkpoint`)
        self.peer_state: dict[str, Any] | None = None  # recovering in place: the state a peer sent
        self.backend: Backend | None = None  # what set up this attempt's process group
        self.outcome_sent: Failed | None = None  # a loop that stayed told the driver it failed
        self.loop_met = False  # `in_loop.meet` was made in this attempt
        self.saver = BackgroundSave()  # this rank's asynchronous save in flight
        self._send_lock = threading.Lock()  # the saver's thread sends too
        self._saved_async = 0  # the iteration of this rank's latest asynchronous save
        self._committed_async = 0  # the latest one the driver said it committed
        self._async_names: set[str] = set()  # the names this rank gave its asynchronous saves
        self._latest = info.checkpoint  # the run's latest committed checkpoint, as far as this rank knows
        self._collective_calls = 0  # the `gather`s made so far in this attempt
        self._validated: set[str] = set()  # checkpoints whose validation the driver said ended

    def send(self, message: Any) -> None:
        with self._send_lock:
            self.channel.send(message)

    def check_attempt(self) -> None:
        """Called before and between the checkpoint files a rank writes: when the driver has
        hung up on this rank, the attempt ended without it (its machine froze or lost the
        network, and came back), and a later attempt may be writing the same checkpoint names
        now. The process then ends at once, so that neither it nor the rest of the training
        function (a `finally`, another thread) writes anything more."""
        if self.channel.hung_up():
            sys.stderr.write(f"unbroken: rank {self.info.world_rank} of attempt {self.info.attempt}: the "
                             "driver ended this attempt; this rank stops without writing\n")
            sys.stderr.flush()
            os._exit(ATTEMPT_ENDED_EXIT)

    def receive(self, kind: type) -> Any:
        """The driver's next message of `kind`. A `Committed`, and the reply to this rank's
        latest report, that arrive first are taken on the way (the driver answers a report
        round and a collective call in whichever order they complete)."""
        while True:
            message = self.channel.recv()
            if isinstance(message, kind):
                return message
            if isinstance(message, Committed):
                self._note_committed(message)
            elif isinstance(message, Validated):
                self._validated.add(message.name)
            elif isinstance(message, Reply) and self._awaiting_reply:
                self._took(message)
            else:
                raise AssertionError(f"unexpected message from the driver: {message!r}")

    def _note_committed(self, message: Committed) -> None:
        if message.iteration > self._committed_async:
            self._committed_async = message.iteration
            self._follow(message.name)

    def _follow(self, name: str) -> None:
        """The checkpoint `name` of this run committed: it is the latest (commits come in order)."""
        storage = self.info.storage
        self._latest = Checkpoint(storage.url(name), storage.filesystem_arg)

    def _took(self, reply: Reply) -> None:
        self._reply, self._verdict_at = reply, reply.verdict_at
        self._awaiting_reply = False
        if reply.committed is not None:
            self._follow(reply.committed)

    def _take_reply(self) -> None:
        if self._awaiting_reply:
            self._took(self.receive(Reply))
        if self._reply.stop:
            raise StopTraining(self._reply.attach)

    def gather(self, op: str, data: bytes | None = None, error: str = "") -> Gathered:
        """Make collective call `op` through the driver (`train.collective` with no process
        group): waits until every rank has made it; rank 0's `data`, or the error to raise."""
        self._collective_calls += 1
        self.send(Gather(self._collective_calls - 1, op, data, error))
        return self.receive(Gathered)

    def should_checkpoint(self) -> bool:
        self._take_reply()
        return self._reply.checkpoint

    def report(self, metrics: dict[str, Any], checkpoint: Checkpoint | None = None,
               name: str | None = None, delete_local: bool = False, asynchronous: bool = False,
               validation: dict[str, Any] | None = None, at_end: bool = False) -> None:
        """Send this rank's report; with `checkpoint`, stage its files first (under the
        checkpoint directory `name` when given, checked by `commit.check_custom_name`) and
        then, with `delete_local`, delete the local directory. `asynchronous`: stage them in
        the background instead (the directory must stay as it is until then, unless
        `delete_local`: then it is moved aside at once and deleted once staged).
        `validation`: the validation request for the checkpoint (`validation_request`).
        `at_end` (no checkpoint): should this round end the run, the rank can save its
        checkpoint after all; it learns the verdict before this returns, and a
        StopTraining with `attach` asks it to (`attach`)."""
        metrics = recordable(metrics, in_trial=self.info.trial_name is not None)
        if checkpoint is not None:
            self.saving()
        self._take_reply()  # from here on, every earlier report's synchronous checkpoint is committed
        self.saver.check()
        iteration = self.iteration + 1
        files = None
        if checkpoint is not None and asynchronous:
            self._check_local(checkpoint)
            directory = _move_aside(checkpoint.path, iteration) if delete_local else checkpoint.path
            job = self._background_job(iteration, name, lambda: (directory, delete_local))
            report = Report(iteration, metrics, None, name, pending=True, validation=validation)
            self._send_report(report, job)
            return
        if checkpoint is not None:
            self._check_local(checkpoint)
            storage = self.info.storage
            if name is not None:
                check_name_free(storage, name, self._async_names)
            staging = staging_name(iteration, self.info.attempt, storage, name)
            files = write_rank_files(storage, staging, checkpoint.path, self.info.world_rank,
                                     guard=self.check_attempt)
            if delete_local:
                shutil.rmtree(checkpoint.path, ignore_errors=True)
        self._send_report(Report(iteration, metrics, files, name if files is not None else None,
                                 validation=validation if files is not None else None,
                                 at_end=at_end and files is None))

    def attach(self, directory: str) -> None:
        """Stage this rank's files in `directory` as the checkpoint of its latest report, which
        ended the run and asked for them (StopTraining's `attach`), and tell the driver."""
        storage = self.info.storage
        files = write_rank_files(storage, staging_name(self.iteration, self.info.attempt, storage, None),
                                 directory, self.info.world_rank, guard=self.check_attempt)
        faults.point("before_attach_staged")  # crash tests: staged, and the driver not told yet
        self.send(Staged(self.iteration, files))

    def report_async(self, metrics: dict[str, Any], produce: Callable[[], tuple[str, bool]]) -> None:
        """Report with a checkpoint that is written in the background: `produce()`, called in
        the saver's thread, returns the local directory of this rank's files and whether to
        delete it once they are staged. The caller has already snapshotted what it saves."""
        metrics = recordable(metrics, in_trial=self.info.trial_name is not None)
        self.saving()
        self._take_reply()
        self.saver.check()
        iteration = self.iteration + 1
        job = self._background_job(iteration, None, produce)
        self._send_report(Report(iteration, metrics, None, None, pending=True), job)

    @staticmethod
    def _check_local(checkpoint: Any) -> None:
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError("train.report(checkpoint=...) needs a Checkpoint, e.g. "
                            "Checkpoint.from_directory(path)")
        if not checkpoint.is_local:
            raise ValueError(f"train.report needs a checkpoint in a local directory, got "
                             f"{checkpoint.path}. Hint: write the files to a temporary "
                             "directory and pass Checkpoint.from_directory(it)")

    def _background_job(self, iteration: int, name: str | None,
                        produce: Callable[[], tuple[str, bool]]) -> Callable[[], None]:
        """The save of report `iteration`, to start once the report is sent; first waits for
        this rank's previous save to be durable (one in flight)."""
        self.saver.wait()
        storage = self.info.storage
        if name is not None:
            check_name_free(storage, name, self._async_names)  # the driver may not have committed them yet
            self._async_names.add(name)
        staging = staging_name(iteration, self.info.attempt, storage, name)
        return stage_job(storage, staging, iteration, self.info.world_rank, produce, self.send,
                         guard=self.check_attempt)

    def saving(self) -> None:
        """The save of the coming report begins now (TrainState calls it before it serializes):
        from here to the report's send, the loop is blocked saving (`Report.save_s`)."""
        if self._save_t0 is None:
            self._save_t0 = time.monotonic()

    def _send_report(self, report: Report, save: Callable[[], None] | None = None) -> None:
        """Send `report`, then start its background `save` (its `Staged` must follow it)."""
        iteration = report.iteration
        asked = (self._reply.checkpoint or report.at_end
                 or (self._verdict_at is not None and iteration >= self._verdict_at))
        if self._save_t0 is not None:
            report.save_s = time.monotonic() - self._save_t0
            self._save_t0 = None
        report.auto = self.auto_checkpoint
        if self.forward_clock is not None:
            report.forward_s = self.forward_clock.take()
        self.send(report)
        if save is not None:
            self.saver.start(save)
            self._saved_async = iteration
        faults.point("after_report")
        self.iteration = iteration
        self.reports += 1
        if self.jit is not None:
            self.jit.after_report(iteration)
        self._awaiting_reply = True
        self._reply = NO_REPLY
        if asked:
            # The driver asked for this checkpoint (preemption), or this report may be the last:
            # take its verdict now, so that a stop ends the loop right after this report
            # instead of after one more iteration.
            self._take_reply()

    def finish(self) -> int:
        """Wait for the driver to have processed the last report, and for this rank's save in
        flight; returns how many reports this rank made (its `Done`)."""
        try:
            self._take_reply()
        except StopTraining:
            pass
        self.saver.wait()
        return self.reports

    def drain(self) -> None:
        """The loop failed: let the save in flight finish (the driver commits it if every rank's
        files arrive), so that a failure costs no more than the work since that save."""
        try:
            self.saver.wait()
        except BaseException as e:  # noqa: BLE001 - the loop's own error is the one to report
            log.warning("rank %d: its checkpoint save in the background failed too: %s",
                        self.info.world_rank, e)

    def get_checkpoint(self) -> Checkpoint | None:
        """The run's latest committed checkpoint (Ray V2): the one the attempt started from
        until a report's checkpoint commits. Waits for the driver's verdict on this rank's
        latest report (its round's checkpoint commits before it)."""
        try:
            self._take_reply()
        except StopTraining:
            pass  # the next report raises it again: the stop is kept in the reply taken
        return self._latest

    def reported_checkpoints(self, validated: bool = False) -> list[ReportedCheckpoint]:
        """The run's committed checkpoints, oldest first, once the checkpoint of this rank's
        latest report is committed (the driver's reply to it says so, or its `Committed` for an
        asynchronous save); with `validated`, also once every validation asked for so far has
        ended (when the trainer validates at all)."""
        self._take_reply()
        self.saver.wait()
        while self._committed_async < self._saved_async:
            self._note_committed(self.receive(Committed))
        storage = self.info.storage
        markers = []
        for name in scan(storage)[0]:
            try:
                markers.append(read_marker(storage, name))
            except TornCheckpointError:
                continue
        records = validation_record.read_all(storage, markers)
        waiting = {m.name for m in markers if m.validation is not None and m.name not in records}
        while validated and self.info.validates and waiting - self._validated:
            self._validated.add(self.receive(Validated).name)
        records.update(validation_record.read_all(storage, [m for m in markers if m.name in waiting]))
        return [ReportedCheckpoint(Checkpoint(storage.url(m.name), storage.filesystem_arg),
                                   validation_record.metrics(m, records.get(m.name)),
                                   ReportedCheckpointStatus(validation_record.status(m, records.get(m.name))))
                for m in markers]

    def save_return_value(self, value: Any) -> None:
        """Keep what rank 0's training function returned, for `Result.return_value`."""
        if self.info.world_rank != 0 or value is None:
            return  # None is what a Result reads when the finishing attempt wrote nothing
        try:
            return_value.save(self.info.storage, self.info.attempt, value)
        except (TypeError, AttributeError, pickle.PicklingError) as e:
            log.warning("the training function's return value (%s) cannot be saved (%s); "
                        "Result.return_value will be None", type(value).__name__, e)

    def get_dataset_shard(self, name: str) -> Any:
        if name not in self.datasets:
            raise KeyError(f"no dataset named {name!r}; the trainer has: {sorted(self.datasets)}. "
                           "Hint: pass datasets={name: ...} to the trainer")
        return shard(self.datasets[name], self.info.world_rank, self.info.world_size)


def _move_aside(path: str, iteration: int) -> str:
    """Take over a reported directory that is to be deleted anyway: a rename, so that the caller
    may delete or reuse the path at once while the files are staged from the new one."""
    aside = f"{path.rstrip(os.sep)}.unbroken-save-{iteration}"
    os.rename(path, aside)
    return aside


def shard(dataset: Any, rank: int, world_size: int) -> Any:
    """This rank's part of a dataset: every world_size-th item starting at rank."""
    if is_dataset_builder(dataset):
        dataset = dataset()
    indices = range(rank, len(dataset), world_size)
    if isinstance(dataset, (list, tuple)):
        return type(dataset)(dataset[i] for i in indices)
    try:
        from torch.utils.data import Dataset, Subset
    except ImportError:  # pragma: no cover - torch is optional for DataParallelTrainer
        return [dataset[i] for i in indices]
    if isinstance(dataset, Dataset) or hasattr(dataset, "__getitem__"):
        return Subset(dataset, list(indices))
    return [dataset[i] for i in indices]


_current: Session | None = None


def install(session: Session | None) -> None:
    global _current
    _current = session


def current(what: str) -> Session:
    if _current is None:
        raise RuntimeError(f"{what} can only be called inside a training function run by a "
                           "trainer's fit(). Hint: call it from train_loop_per_worker")
    return _current

