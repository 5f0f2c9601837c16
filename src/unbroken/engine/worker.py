"""The worker process: set up, run the trainer's training_loop, report how it ended.

Engine-independent: the local engine runs `worker_main` in a forked process; any other
engine would run the same function with its own connection object.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from dataclasses import dataclass
from typing import Any

import cloudpickle

from unbroken import session as session_mod
from unbroken.session import Session, StopTraining, WorkerInfo


@dataclass
class WorkerPayload:
    info: WorkerInfo
    trainer: Any


class Pickled:
    """Carries a payload to a process that is not forked from the driver (cloudpickle, so
    functions defined in __main__ travel too). Under fork it is never pickled at all."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __reduce__(self):
        return (_unpickle, (cloudpickle.dumps(self.obj),))


def _unpickle(data: bytes) -> Pickled:
    # Unpickled only in a worker started by a forkserver: ignore terminal signals from here on.
    _ignore_terminal_signals()
    return Pickled(cloudpickle.loads(data))


def _die_with_parent(parent_pid: int | None) -> None:
    """Linux: the kernel SIGKILLs this worker when its parent (the driver, or the forkserver
    that exits with the driver) dies, even by SIGKILL."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def _ignore_terminal_signals() -> None:
    # The driver coordinates shutdown; a Ctrl-C in the terminal must not kill workers mid-write.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _set_up_process(info: WorkerInfo, parent_pid: int | None) -> None:
    _ignore_terminal_signals()
    _die_with_parent(parent_pid)
    os.environ.update(info.env)
    os.environ.update(RANK=str(info.world_rank), WORLD_SIZE=str(info.world_size),
                      LOCAL_RANK=str(info.local_rank), LOCAL_WORLD_SIZE=str(info.local_world_size),
                      NODE_RANK=str(info.node_rank), OMP_NUM_THREADS=str(info.cpus))
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(info.cpus)


def worker_main(payload: Pickled, conn: Any, parent_pid: int | None) -> None:
    work: WorkerPayload = payload.obj
    info, trainer = work.info, work.trainer
    _set_up_process(info, parent_pid)
    if not info.storage.is_local:
        # An async filesystem (s3fs, gcsfs) inherited through fork is tied to the driver's event
        # loop; a pickle round trip gives this process its own instance.
        info.storage, info.checkpoint = cloudpickle.loads(cloudpickle.dumps((info.storage, info.checkpoint)))
    session = Session(info, conn, getattr(trainer, "datasets", None))
    session_mod.install(session)
    backend = trainer._backend()

    def rendezvous(value: Any) -> Any:
        if info.world_rank == 0:
            conn.send(("rendezvous", value))
            return value
        kind, value = conn.recv()
        assert kind == "rendezvous", kind
        return value

    code = 0
    try:
        backend.on_start(session, rendezvous)
        try:
            trainer.training_loop()
        except StopTraining:
            pass
        session.finish()
    except BaseException as e:  # noqa: BLE001 - everything is reported to the driver
        code = 1
        text = traceback.format_exc()
        try:
            blob = cloudpickle.dumps(e)
        except Exception:
            blob = None
        try:
            conn.send(("error", text, blob))
        except OSError:
            pass
    finally:
        try:
            backend.on_shutdown(session)
        except Exception:
            pass
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
