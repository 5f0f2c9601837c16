"""A worker's body, the same on every engine: set up, run the trainer's training loop, say
how it ended.

`serve(payload, channel)` is all an engine runs in a rank: one attempt (`run_worker`), and
the next ones when the run recovers in place; it never ignores signals,
ties its life to a parent or exits the process (a long-lived worker of another engine must
outlive it). Those process-level concerns belong to the engine's own wrapper, e.g.
`engine.local.worker_process`.
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass
from typing import Any

import cloudpickle

from unbroken.errors import StorageNotSharedError
from unbroken.worker import jit as jit_checkpoint
from unbroken.worker import peer_state
from unbroken.worker import session as session_mod
from unbroken.worker.channel import Channel
from unbroken.worker.protocol import Done, Failed, Outcome, Rejoin, Rendezvous
from unbroken.worker.session import Session, StopTraining, WorkerInfo


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
        try:
            message = channel.recv()
            while not isinstance(message, Rejoin):  # what was on its way to the failed attempt
                message = channel.recv()
        except (OSError, EOFError):
            break  # the driver is gone, or gave up and closed this rank's channel
        outcome, staying = run_worker(cloudpickle.loads(message.payload), channel, staying.kept)
    return outcome


@dataclass
class Staying:
    """This rank stays for the next attempt; `kept`: the state it sends to every rank then
    (its source rank only)."""

    kept: dict[str, Any] | None


def run_worker(payload: WorkerPayload, channel: Channel,
               kept: dict[str, Any] | None = None) -> tuple[Outcome, Staying | None]:
    """Run one rank's part of an attempt; sends the outcome (Done or Failed) to the driver as
    the last message, and returns it, with whether the driver asked this rank to stay for
    the next attempt. `kept`: recovering in place, the state this rank sends to every rank."""
    info, trainer = payload.info, payload.trainer
    _set_up(info)
    session = Session(info, channel, getattr(trainer, "datasets", None))
    session_mod.install(session)
    backend = trainer._backend()

    def rendezvous(value: Any) -> Any:
        if info.world_rank == 0:
            channel.send(Rendezvous(value))
            return value
        return session.receive(Rendezvous).value  # a `Validated` may come first (a validation ended)

    outcome: Outcome
    staying: Staying | None = None
    try:
        try:
            if info.probe is not None:
                check_storage_shared(info)
            backend.on_start(session, rendezvous)
            peer_state.share(session, kept)
            kept = None
            try:
                trainer.training_loop()
            except StopTraining:
                pass
            outcome = Done(session.finish())
        except BaseException as e:  # noqa: BLE001 - everything is reported to the driver
            session.drain()
            try:
                blob = cloudpickle.dumps(e)
            except Exception:
                blob = None
            outcome = Failed(traceback.format_exc(), blob)
        kept = None
        try:
            offered = isinstance(outcome, Failed) and jit_checkpoint.offer(session)
            channel.send(outcome)
            if isinstance(outcome, Failed):  # after it: this error, not a peer's, is the first
                peer_state.release_group(session, backend)
            stay = jit_checkpoint.save_if_asked(session) if offered else None
            if stay is not None:
                staying = Staying(peer_state.keep(session) if stay.source == info.world_rank else None)
        except (OSError, EOFError):
            pass  # the driver is gone
    finally:
        try:
            backend.on_shutdown(session)
        except Exception:
            pass
        session_mod.install(None)
    return outcome, staying
