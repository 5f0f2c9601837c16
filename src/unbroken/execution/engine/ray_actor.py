"""What the Ray engine runs in the cluster, and how the driver attaches to it: `connect`,
the versions every node must share, and `RankActor`, one rank's process on a node (its
`run` serves the rank's attempts over its connection to the driver, `engine.ray_link`);
how the driver ends such actors and reads why one died."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Client
from typing import Any

import ray
import ray.exceptions

import unbroken
from unbroken.core import shipping
from unbroken.errors import WorkerDied
from unbroken.execution.engine.ray_link import no_delay
from unbroken.worker import preemption, stacks
from unbroken.worker.channel import PipeChannel
from unbroken.worker.runner import serve


def connect() -> None:
    """Attach this process to the Ray cluster (RAY_ADDRESS, else a local Ray, as Ray Train
    does), unless it already is.

    `ray.init` replaces the process's SIGTERM and SIGINT handlers with Ray's, which end the
    driver at once; the handlers in place before (the controller's preemption handling, while
    fit() runs) are put back."""
    if ray.is_initialized():
        return
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    ray.init(address=os.environ.get("RAY_ADDRESS") or None)
    if threading.current_thread() is threading.main_thread():
        for sig, handler in kept.items():
            if handler is not None:
                signal.signal(sig, handler)


def cluster_address() -> str:
    """The address a process on any node passes to `ray.init` to join this driver's cluster."""
    connect()
    return ray.get_runtime_context().gcs_address


def node_alive(node_id: str) -> bool:
    """Whether Ray counts the node `node_id` among its live nodes."""
    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())


# After a node was lost: how long to wait for Ray's verdict on it (about 15 s with Ray's
# default health checks) before placing anew all the same. What is placed before the verdict
# can land on the dying node again.
VERDICT_WAIT_S = 60.0


def await_verdict(node_id: str, wait_s: float = VERDICT_WAIT_S) -> None:
    """Return once Ray no longer lists node `node_id` alive, or after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while node_alive(node_id) and time.monotonic() < deadline:
        time.sleep(0.2)


def versions() -> dict[str, str]:
    """What must match between the driver and every node for a payload to run there."""
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "none"
    return {"python": ".".join(map(str, sys.version_info[:2])), "unbroken": unbroken.__version__,
            "torch": torch_version}


class RankActor:
    """One rank's process on a node. Its methods run one at a time, on the main thread."""

    def meta(self) -> dict[str, Any]:
        """Where this actor runs and what it has (it imports torch now, while its peers start)."""
        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "address": ray.util.get_node_ip_address(),
                "pid": os.getpid(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "versions": versions()}

    def warm(self, ddp: bool) -> None:
        """Import now what a rank imports, so that this spare starts a restarted rank at once:
        torch, and torch._dynamo, which DDP imports on first use. The imports run in a thread
        of the lowest CPU priority (on Linux a thread has its own), so that they take only
        what the running ranks leave idle; the spare's own thread keeps its priority."""

        def imports() -> None:
            try:
                os.setpriority(os.PRIO_PROCESS, 0, 19)  # this thread only, on Linux
            except (OSError, AttributeError):
                pass
            import torch  # noqa: F401

            if ddp:
                import torch._dynamo  # noqa: F401

        thread = threading.Thread(target=imports, name="unbroken-warm-up")
        thread.start()
        thread.join()

    def run(self, payload: bytes, rank: int, address: tuple[str, int], authkey: bytes,
            sys_path: list[str], shipped: dict[str, Any] | None = None) -> str:
        """Run the rank's part of the attempt; returns the outcome's name. The driver's import
        path is added where its directories exist here, so that functions pickled by reference
        (defined in the driver's modules) load as they do in a local worker. `shipped`: the
        payload's Ray Datasets, as object references (`core.shipping`)."""
        sys.path.extend(p for p in sys_path if p not in sys.path and os.path.isdir(p))
        work = shipping.loads(payload, shipped)
        conn = Client(tuple(address), authkey=authkey)
        no_delay(conn)
        conn.send(("hello", rank))
        stacks.arm()
        preemption.arm(notify_on_sigterm=False)  # Ray owns SIGTERM here; node drains are the notices
        try:
            return type(serve(work, PipeChannel(conn))).__name__
        finally:
            conn.close()
            stacks.forget(os.getpid())


def why_died(rank: int, error: BaseException, meta: dict[str, Any]) -> WorkerDied:
    """The engine-neutral cause for a rank whose actor call failed with `error`."""
    where = f"node {meta['address']} ({meta['node_id'][:12]})"
    text = str(error).strip().splitlines()
    first = text[0] if text else type(error).__name__
    if isinstance(error, ray.exceptions.ActorUnavailableError):
        return WorkerDied(rank, node_lost=f"{where} unreachable: {first}", engine="ray")
    if isinstance(error, ray.exceptions.ActorDiedError) and getattr(error, "preempted", False):
        return WorkerDied(rank, node_lost=f"{where} preempted", engine="ray")
    if isinstance(error, ray.exceptions.ActorDiedError) and not node_alive(meta["node_id"]):
        # Where Ray declares the node dead first, its actors' calls fail as died, not unavailable.
        return WorkerDied(rank, node_lost=f"{where} dead: {first}", engine="ray")
    return WorkerDied(rank, cause=f"its actor on {where} died: {type(error).__name__}: {first}",
                      engine="ray")


def sigkill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def kill_actors(actors: list[Any]) -> None:
    for actor in filter(None, actors):
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
