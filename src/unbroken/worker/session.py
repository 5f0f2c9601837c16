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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from unbroken.core import faults
from unbroken.store import return_value
from unbroken.store.checkpoint import Checkpoint
from unbroken.store.commit import staging_name, write_rank_files
from unbroken.store.history import recordable
from unbroken.worker.async_save import AsyncSaves, stage_job
from unbroken.worker.committed_checkpoints import CommittedCheckpoints
from unbroken.worker.dataset_shard import shard
from unbroken.worker.protocol import Committed, Failed, Gather, Gathered, Reply, Report, Staged, Validated
from unbroken.worker.replies import Replies, StopTraining
from unbroken.worker.report_config import ReportedCheckpoint
from unbroken.worker.report_notes import ReportNotes
from unbroken.worker.reported_directory import check_local, move_aside
from unbroken.worker.train_context import TrainContext
from unbroken.worker.worker_info import WorkerInfo

if TYPE_CHECKING:
    from unbroken.worker.backend import Backend
    from unbroken.worker.channel import Channel
    from unbroken.worker.forward_clock import ForwardClock
    from unbroken.worker.recovery.just_in_time import Tracker


log = logging.getLogger("unbroken")


ATTEMPT_ENDED_EXIT = 75  # the exit status of a rank that finds its attempt over (check_attempt)


class Session:
    """One worker's connection to the driver.

    Its fields change only through its own methods; what the rank's other parts built and
    the session follows (the just-in-time tracker, the DDP wrappers, the state a peer sent)
    is handed to it through the methods that say what the change means, and read from it.
    """

    def __init__(self, info: WorkerInfo, channel: Channel, datasets: dict[str, Any] | None,
                 backend: Backend) -> None:
        self.info = info
        self.channel = channel
        self.datasets = datasets or {}
        self.backend = backend  # what sets up this attempt's process group
        self.iteration = info.start_iteration
        self.reports = 0
        self.context = TrainContext(self)
        self.jit: Tracker | None = None  # a TrainState that can save just in time (`jit_checkpoint`)
        self.wrappers: list[Any] = []  # the DDP wrappers prepare_model made in this process
        self.peer_state: dict[str, Any] | None = None  # recovering in place: the state a peer sent
        self.outcome_sent: Failed | None = None  # a loop that stayed told the driver it failed
        self._loop_met = False  # `in_loop.meet` was made in this attempt
        self._notes = ReportNotes()
        self._replies = Replies()
        self._saves = AsyncSaves()
        self._send_lock = threading.Lock()  # the saver's thread sends too
        self._latest = info.checkpoint  # the run's latest committed checkpoint, as far as this rank knows
        self._collective_calls = 0  # the `gather`s made so far in this attempt
        self._validated: set[str] = set()  # checkpoints whose validation the driver said ended

    # -- what the rank's other parts hand over ------------------------------------------------

    def carry_over(self, previous: Session) -> None:
        """This attempt goes on in the training loop that `previous`, the last attempt's
        session in this process, served (`runner.rejoin_in_loop`): take over what that loop
        built (its armed TrainState's tracker, its DDP wrappers, its model's forward clock)
        and its context, which describes this attempt from now on."""
        self.jit, self.wrappers = previous.jit, previous.wrappers
        self._notes.time_forward(previous._notes.forward_clock)
        self.context = previous.context
        self.context.follow(self)
        if self.jit is not None:
            self.jit.follow_rank(self.info.world_rank)

    def track(self, tracker: Tracker) -> None:
        """A TrainState was armed for just-in-time checkpoints (`jit.arm`): `tracker`, the
        latest armed, is the one that follows every report and is saved after a failure."""
        self.jit = tracker

    def wrapped(self, wrapper: Any, clock: ForwardClock) -> None:
        """`prepare_model` wrapped a model in DDP: `wrapper` is one to initialise again when a
        loop stays (`in_loop`), and `clock`, on its module, gives the reports' forward
        seconds from now on (the clock of a model wrapped before stops)."""
        self.wrappers.append(wrapper)
        self._notes.time_forward(clock)

    def release_wrappers(self) -> None:
        """The process group ends and no loop goes on with it (`peer_state.release_group`):
        drop the DDP wrappers, so that nothing here holds on to the group."""
        self.wrappers.clear()

    def auto_checkpoints(self, auto: bool) -> None:
        """Whether this rank's reports from now on leave their checkpoints to the driver
        (`TrainState.report(checkpoint="auto")`): each report says so (`Report.auto`)."""
        self._notes.auto = auto

    def hold_peer_state(self, state: dict[str, Any] | None) -> None:
        """Recovering in place (`peer_state.share`): `state`, what the source rank kept, is the
        state `TrainState.restore` loads instead of a checkpoint."""
        self.peer_state = state

    def peer_state_loaded(self) -> None:
        """`TrainState.restore` loaded the state a peer sent: a later restore reads the run's
        latest checkpoint again."""
        self.peer_state = None

    def reached_loop(self) -> bool:
        """The training loop reached `TrainState.for_each_batch` (`in_loop.meet`): True the
        first time in this attempt, when the ranks are to meet."""
        first, self._loop_met = not self._loop_met, True
        return first

    def loop_failed(self, outcome: Failed) -> None:
        """The loop stays in this process after a failure (`runner.rejoin_in_loop`) and tells
        the driver `outcome`: should the driver let this rank go, that was its last word."""
        self.outcome_sent = outcome

    def wait_for_save(self) -> None:
        """Block until this rank's asynchronous save in flight is written (raising its error):
        TrainState waits so before it copies the next, one copy in memory at a time."""
        self._saves.wait()

    # -- the driver's side of the conversation ---------------------------------------------------

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
            elif isinstance(message, Reply) and self._replies.awaiting:
                self._took(message)
            else:
                raise AssertionError(f"unexpected message from the driver: {message!r}")

    def _note_committed(self, message: Committed) -> None:
        if self._saves.committed(message.iteration):
            self._follow(message.name)

    def _follow(self, name: str) -> None:
        """The checkpoint `name` of this run committed: it is the latest (commits come in order)."""
        storage = self.info.storage
        self._latest = Checkpoint(storage.url(name), storage.filesystem_arg)

    def _took(self, reply: Reply) -> None:
        self._replies.took(reply)
        if reply.committed is not None:
            self._follow(reply.committed)

    def _take_reply(self) -> None:
        if self._replies.awaiting:
            self._took(self.receive(Reply))
        self._replies.stop_if_told()

    def gather(self, op: str, data: bytes | None = None, error: str = "") -> Gathered:
        """Make collective call `op` through the driver (`train.collective` with no process
        group): waits until every rank has made it; rank 0's `data`, or the error to raise."""
        self._collective_calls += 1
        self.send(Gather(self._collective_calls - 1, op, data, error))
        return self.receive(Gathered)

    def should_checkpoint(self) -> bool:
        self._take_reply()
        return self._replies.latest.checkpoint

    def preemption(self) -> dict | None:
        """What the driver's replies said of a preemption, up to the reply to the last report
        (taken now, as `should_checkpoint` does: every rank gets the same answer)."""
        self._take_reply()
        return self._replies.preemption

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
        self._saves.check()
        iteration = self.iteration + 1
        files = None
        if checkpoint is not None and asynchronous:
            check_local(checkpoint)
            directory = move_aside(checkpoint.path, iteration) if delete_local else checkpoint.path
            job = self._background_job(iteration, name, lambda: (directory, delete_local))
            report = Report(iteration, metrics, None, name, pending=True, validation=validation)
            self._send_report(report, job)
            return
        if checkpoint is not None:
            check_local(checkpoint)
            storage = self.info.storage
            if name is not None:
                self._saves.check_free(storage, name)
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
        self._saves.check()
        iteration = self.iteration + 1
        job = self._background_job(iteration, None, produce)
        self._send_report(Report(iteration, metrics, None, None, pending=True), job)

    def _background_job(self, iteration: int, name: str | None,
                        produce: Callable[[], tuple[str, bool]]) -> Callable[[], None]:
        """The save of report `iteration`, to start once the report is sent; first waits for
        this rank's previous save to be durable (one in flight)."""
        self._saves.wait()
        storage = self.info.storage
        if name is not None:
            self._saves.claim(storage, name)
        staging = staging_name(iteration, self.info.attempt, storage, name)
        return stage_job(storage, staging, iteration, self.info.world_rank, produce, self.send,
                         guard=self.check_attempt)

    def saving(self) -> None:
        """The save of the coming report begins now (TrainState calls it before it serializes):
        from here to the report's send, the loop is blocked saving (`Report.save_s`)."""
        self._notes.saving()

    def _send_report(self, report: Report, save: Callable[[], None] | None = None) -> None:
        """Send `report`, then start its background `save` (its `Staged` must follow it)."""
        iteration = report.iteration
        asked = self._replies.wanted_now(iteration, report.at_end)
        self._notes.stamp(report)
        self.send(report)
        if save is not None:
            self._saves.start(save, iteration)
        faults.point("after_report")
        self.iteration = iteration
        self.reports += 1
        if self.jit is not None:
            self.jit.after_report(iteration)
        self._replies.sent()
        if asked:
            self._take_reply()

    def finish(self) -> int:
        """Wait for the driver to have processed the last report, and for this rank's save in
        flight; returns how many reports this rank made (its `Done`)."""
        try:
            self._take_reply()
        except StopTraining:
            pass
        self._saves.wait()
        return self.reports

    def drain(self) -> None:
        """The loop failed: let the save in flight finish (the driver commits it if every rank's
        files arrive), so that a failure costs no more than the work since that save."""
        try:
            self._saves.wait()
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
        self._saves.wait()
        while self._saves.uncommitted:
            self._note_committed(self.receive(Committed))
        committed = CommittedCheckpoints(self.info.storage)
        while validated and self.info.validates and committed.validating - self._validated:
            self._validated.add(self.receive(Validated).name)
        return committed.reported()

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


_current: Session | None = None


def install(session: Session | None) -> None:
    """Make `session` this process's session (None: the process is between attempts)."""
    global _current
    _current = session


def active() -> Session | None:
    """This process's session, or None outside a run (a module that also works outside one)."""
    return _current


def current(what: str) -> Session:
    """This process's session; `what`, called outside a run, says so in a RuntimeError."""
    if _current is None:
        raise RuntimeError(f"{what} can only be called inside a training function run by a "
                           "trainer's fit(). Hint: call it from train_loop_per_worker")
    return _current

