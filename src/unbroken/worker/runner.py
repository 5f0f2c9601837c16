"""A worker's body, the same on every engine: set up, run the trainer's training loop, say
how it ended.

`serve(payload, channel)` is all an engine runs in a rank: one attempt (`run_worker`), and
the next ones when the run recovers in place (`rejoin_in_loop` for a loop that goes on
without leaving the training function); an engine that keeps the process for another run
serves each one `next_run` brings (`process_reuse`). It never ignores signals,
ties its life to a parent or exits the process (a long-lived worker of another engine must
outlive it). Those process-level concerns belong to the engine's own wrapper, e.g.
`engine.local.worker_process`.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import cloudpickle

from unbroken.core import shipping
from unbroken.errors import StorageNotSharedError
from unbroken.worker import preemption
from unbroken.worker import session as session_mod
from unbroken.worker.channel import Channel
from unbroken.worker.protocol import Done, Failed, Outcome, Rendezvous
from unbroken.worker.recovery import just_in_time as jit_checkpoint
from unbroken.worker.recovery import peer_state
from unbroken.worker.recovery.messages import Rejoin, Stay
from unbroken.worker.replies import StopTraining
from unbroken.worker.session import Session
from unbroken.worker.worker_info import WorkerInfo

if TYPE_CHECKING:
    from unbroken.worker.backend import Backend


@dataclass
class WorkerPayload:
    info: WorkerInfo
    trainer: Any


def _set_up(info: WorkerInfo) -> None:
    os.environ.update(info.env)
    os.environ.update(RANK=str(info.world_rank), WORLD_SIZE=str(info.world_size),
                      LOCAL_RANK=str(info.local_rank), LOCAL_WORLD_SIZE=str(info.local_world_size),
                      NODE_RANK=str(info.node_rank), OMP_NUM_THREADS=str(info.cpus))
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(info.cpus)
    if not info.storage.is_local:
        # An async filesystem (s3fs, gcsfs) inherited through fork is tied to the driver's event
        # loop; a pickle round trip gives this process its own instance.
        info.storage, info.checkpoint = cloudpickle.loads(cloudpickle.dumps((info.storage, info.checkpoint)))


PROBE = ".unbroken/probe"


def check_storage_shared(info: WorkerInfo) -> None:
    """Fail before training when this rank does not see the probe the driver wrote into the
    run directory: a storage path that is not shared by every node (a local disk path on a
    cluster) would scatter the run's checkpoints over the nodes."""
    try:
        seen = info.storage.read_bytes(PROBE).decode()
    except (OSError, ValueError) as e:
        seen = f"nothing ({type(e).__name__})"
    if seen != info.probe:
        raise StorageNotSharedError(
            f"rank {info.world_rank} on node {info.node_address} ({info.node_id}) does not see the run "
            f"directory {info.storage.url()!r} the driver wrote: its probe file {PROBE} holds {seen!r} "
            f"there. {StorageNotSharedError.HINT}")


def serve(payload: WorkerPayload, channel: Channel) -> Outcome:
    """Run this rank's attempts in this process: the first from `payload`; then, each time the
    driver answers a failure with `Stay` (a recovery in place, see `peer_state`), the next
    attempt it sends as a `Rejoin`. Returns the last attempt's outcome."""
    outcome, staying = run_worker(payload, channel)
    while staying is not None:
        if staying.payload is None:
            try:
                staying.payload = _next_attempt(channel)
            except (OSError, EOFError):
                break  # the driver is gone, or gave up and closed this rank's channel
        outcome, staying = run_worker(staying.payload, channel, staying.kept)
    return outcome


@dataclass
class Staying:
    """This rank stays for the next attempt; `kept`: the state it sends to every rank then
    (its source rank only); `payload`: the attempt, once it has come."""

    kept: dict[str, Any] | None
    payload: WorkerPayload | None = None


class RejoinAnew(BaseException):
    """Raised out of a training loop that stayed (`rejoin_in_loop`) when the next attempt is
    not one it can go on in: the training function then runs again from its start, in this
    process, as for any rank that stays. A BaseException so that a user's `except Exception`
    does not swallow it."""

    def __init__(self, staying: Staying) -> None:
        super().__init__("the next attempt runs the training function again")
        self.staying = staying


def run_worker(payload: WorkerPayload, channel: Channel,
               kept: dict[str, Any] | None = None) -> tuple[Outcome, Staying | None]:
    """Run one rank's part of an attempt (and of the next ones its loop goes on into, see
    `rejoin_in_loop`); sends the outcome (Done or Failed) to the driver as the last message,
    and returns it, with whether the driver asked this rank to stay for the next attempt.
    `kept`: recovering in place, the state this rank sends to every rank."""
    backend = payload.trainer._backend()
    _open(payload.info, channel, backend, getattr(payload.trainer, "datasets", None))
    outcome: Outcome
    staying: Staying | None = None
    try:
        try:
            _start(session_mod.current("run_worker"), kept)
            kept = None
            try:
                with preemption.in_training_loop():
                    payload.trainer.training_loop()
            except StopTraining:
                pass
            outcome = Done(session_mod.current("run_worker").finish())
        except RejoinAnew as anew:  # the loop stayed; the next attempt runs the function again
            return session_mod.current("run_worker").outcome_sent, anew.staying
        except BaseException as e:  # noqa: BLE001 - everything is reported to the driver
            session = session_mod.current("run_worker")
            if session.outcome_sent is not None:  # the loop told the driver already, and was let go
                return session.outcome_sent, None
            session.drain()
            outcome = failed(e)
        kept = None
        session = session_mod.current("run_worker")
        try:
            stay = _tell(session, outcome)
            if stay is not None:
                staying = Staying(_kept(session, stay))
        except (OSError, EOFError):
            pass  # the driver is gone
    finally:
        session = session_mod.active()
        try:
            if session is not None:
                backend.on_shutdown(session)
        except Exception:
            pass
        session_mod.install(None)
    return outcome, staying


def rejoin_in_loop(failure: BaseException) -> None:
    """Called by a training loop that caught `failure` and holds the state of its last report
    (`TrainState.for_each_batch`): tell the driver, as any failed rank does, and when it says
    to stay, begin the next attempt in this process without leaving the loop: a new session
    (installed), a new process group, and the state the source rank sends, in
    `session.peer_state`. Raises `failure` when the driver lets this rank go, and `RejoinAnew`
    when the next attempt gives this rank another number or world size (an elastic shrink:
    the loop's loader shares out the epoch among the old number of ranks)."""
    session = session_mod.current("rejoin_in_loop")
    session.drain()
    outcome = failed(failure)
    session.loop_failed(outcome)
    try:
        stay = _tell(session, outcome, keep_wrappers=True)
        if stay is None:
            raise failure
        kept = _kept(session, stay)
        payload = _next_attempt(session.channel)
    except (OSError, EOFError):
        raise failure from None  # the driver is gone
    info = payload.info
    if (info.world_rank, info.world_size) != (session.info.world_rank, session.info.world_size):
        raise RejoinAnew(Staying(kept, payload))
    _open(info, session.channel, session.backend, session.datasets, carried=session)
    _start(session_mod.current("rejoin_in_loop"), kept)


def failed(error: BaseException) -> Failed:
    """The outcome of a rank whose loop raised `error`."""
    try:
        blob = cloudpickle.dumps(error)
    except Exception:
        blob = None
    return Failed("".join(traceback.format_exception(error)), blob, time.time())


def _open(info: WorkerInfo, channel: Channel, backend: Backend, datasets: dict[str, Any] | None,
          carried: Session | None = None) -> None:
    """Set this process up for an attempt and install its session, carrying over what a loop
    that stayed has built (its TrainState's tracker, its model's forward clock)."""
    _set_up(info)
    session = Session(info, channel, datasets, backend)
    if carried is not None:
        session.carry_over(carried)
    session_mod.install(session)


def _start(session: Session, kept: dict[str, Any] | None) -> None:
    """The collective start of an attempt: the storage check, the process group, and the
    state a peer sends when the attempt recovers in place."""
    info, channel = session.info, session.channel

    def rendezvous(value: Any) -> Any:
        if info.world_rank == 0:
            channel.send(Rendezvous(value))
            return value
        return session.receive(Rendezvous).value  # a `Validated` may come first (a validation ended)

    if info.probe is not None:
        check_storage_shared(info)
    session.backend.on_start(session, rendezvous)
    peer_state.share(session, kept)


def _tell(session: Session, outcome: Outcome, keep_wrappers: bool = False) -> Stay | None:
    """Send the attempt's outcome. After a failure: the offer of a just-in-time checkpoint
    first, then the release of the process group, and the driver's word: `Stay`, or None."""
    offered = isinstance(outcome, Failed) and jit_checkpoint.offer(session)
    session.send(outcome)
    if isinstance(outcome, Failed):  # after it: this error, not a peer's, is the first
        peer_state.release_group(session, session.backend, keep_wrappers)
    return jit_checkpoint.save_if_asked(session) if offered else None


def _kept(session: Session, stay: Stay) -> dict[str, Any] | None:
    """What this rank keeps to send every rank of the next attempt: the state of the last
    report on the source rank, nothing on the others."""
    return peer_state.keep(session) if stay.source == session.info.world_rank else None


def next_run(channel: Channel) -> WorkerPayload | None:
    """In a process its engine keeps for another run (`process_reuse`): the next run's
    payload, sent as a `Rejoin` once this rank's run ended cleanly; None once the driver
    closes the link (the process then ends)."""
    try:
        return _next_attempt(channel)
    except (OSError, EOFError):
        return None


def _next_attempt(channel: Channel) -> WorkerPayload:
    """The next attempt's payload, for a rank told to stay."""
    message = channel.recv()
    while not isinstance(message, Rejoin):  # what was on its way to the failed attempt
        message = channel.recv()
    return shipping.loads(message.payload)
