"""A trial's driver on a node of the Ray cluster (see `tune.trial_process` for what the sweep
driver expects of it).

Each trial gets an actor, `TrialHost`, which starts the trial's driver as a process of its
own on the actor's node (`tune.trial_child`), the same process a trial gets on the sweep
driver's machine: its controller takes SIGTERM and SIGINT, and it joins the cluster as a Ray
job of its own, so that its worker actors and placement groups end with it. Lifetimes: the
sweep driver owns the trial actors (Ray ends them when it dies), and a trial's process dies
with its actor (PDEATHSIG), its workers with it.

Placement: Ray's SPREAD, holding `ScalingConfig(trainer_resources=...)` (nothing by default:
a trial's driver waits on its workers, which hold the cluster's slots). A trial actor whose
node is lost (its call fails with `ActorUnavailableError`; or it was preempted; or it died
and its node does not answer) is `lost()`: the sweep driver runs the trial again, from its
last committed checkpoint.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle
import ray
import ray.exceptions
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from unbroken.execution.engine.ray_actor import VERDICT_WAIT_S, cluster_address, connect, node_alive
from unbroken.tune.trial import TrialPayload
from unbroken.worker.protocol import TrialOutcome, TrialPlaced

# How long join() waits for Ray to say that a killed trial actor has ended.
JOIN_WAIT_S = 30.0
# After a trial actor's process died: how long its node has to run a task before it counts as lost.
NODE_ANSWER_S = 10.0


class TrialHost:
    """Starts a trial's driver process on its node, waits for it, and passes signals on to it.
    An asyncio actor: its methods run on one event-loop thread, which lives as long as the
    actor (PDEATHSIG follows the thread that started the child, so it fires only when the
    actor's process dies), and `signal` is answered while `wait` waits. Ray may begin `wait`
    before `start` (a call with large arguments starts later): `wait` waits for `start`."""

    def __init__(self) -> None:
        self._started = asyncio.Event()
        self._child: subprocess.Popen | None = None

    async def start(self, payload: bytes, sys_path: list[str]) -> dict[str, Any]:
        """Start the driver process (`tune.trial_child`); returns where it runs."""
        self._outcome, writer = os.pipe()
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-m", "unbroken.tune.trial_child", str(os.getpid()), str(writer)],
                stdin=subprocess.PIPE, pass_fds=(writer,))
        finally:
            os.close(writer)
            self._started.set()
        assert self._child.stdin is not None
        with self._child.stdin as stdin:
            stdin.write(pickle.dumps((sys_path, payload)))
        return {"node_id": ray.get_runtime_context().get_node_id(), "address": ray.util.get_node_ip_address(),
                "pid": self._child.pid}

    async def wait(self) -> tuple[TrialOutcome | None, int]:
        """The trial's outcome (None if its process ended without one) and its exit code."""
        await self._started.wait()
        return await asyncio.get_running_loop().run_in_executor(None, self._wait)

    def _wait(self) -> tuple[TrialOutcome | None, int]:
        if self._child is None:  # it could not be started: `start` raised, and says why
            return None, 1
        outcome = None
        with Connection(self._outcome, writable=False) as conn:
            try:
                outcome = conn.recv()
            except (EOFError, OSError):
                pass
        return outcome, self._child.wait()

    async def signal(self, signum: int) -> None:
        try:
            if self._child is not None:
                self._child.send_signal(signum)
        except ProcessLookupError:
            pass


def _answer() -> bool:
    return True


def actor_options(trainer_resources: dict[str, float] | None) -> dict[str, Any]:
    """The trial actor's Ray options: `trainer_resources` as Ray's num_cpus, num_gpus, memory
    and custom resources."""
    resources = dict(trainer_resources or {})
    return {"num_cpus": resources.pop("CPU", 0), "num_gpus": resources.pop("GPU", 0),
            "memory": resources.pop("memory", None), "resources": resources or None,
            "max_restarts": 0, "scheduling_strategy": "SPREAD"}


class RayTrialProcess:
    """One trial's driver actor, seen by the sweep driver as a trial's process is.

    Ray says when the actor is placed and when its call ends through callbacks on another
    thread; they turn into a message on `conn` and the end of `sentinel`, which the sweep
    driver waits on with its other trials."""

    reusable = False  # a trial's actor runs one trial (see trial_process)

    def __init__(self, payload: TrialPayload, trainer_resources: dict[str, float] | None) -> None:
        connect()
        self.conn, self._writer = mp.Pipe(duplex=False)
        self.sentinel, self._ended_w = os.pipe()
        self._lock = threading.Lock()
        self._open = True
        self.meta: dict[str, Any] | None = None
        self._lost: str | None = None
        self._died = False  # its process died (a lost node, or a kill on a live one: see `lost`)
        self._error = "it ended"
        # The trial's process joins this cluster, whatever RAY_ADDRESS says on its node.
        payload.env = {**payload.env, "RAY_ADDRESS": cluster_address()}
        self.actor = ray.remote(TrialHost).options(**actor_options(trainer_resources)).remote()
        started = self.actor.start.remote(cloudpickle.dumps(payload), list(sys.path))
        self._refs = (started, self.actor.wait.remote())  # kept: a ref dropped may never call back
        self._refs[0].future().add_done_callback(self._placed)
        self._refs[1].future().add_done_callback(self._ended)

    def _send(self, message: Any) -> None:
        with self._lock:
            if self._open:
                self._writer.send(message)

    def _placed(self, future: Any) -> None:
        try:
            meta = future.result()
        except Exception:  # noqa: BLE001 - the actor died before it started: `_ended` says why
            return
        self.meta = meta
        self._send(TrialPlaced(meta["node_id"], meta["address"], meta["pid"]))

    def _ended(self, future: Any) -> None:
        try:
            outcome, code = future.result()
            if outcome is not None:
                self._send(outcome)
            else:
                self._error = (f"its process was killed by {signal.Signals(-code).name}" if code < 0
                               else f"its process exited with code {code}")
        except ray.exceptions.ActorUnavailableError as e:
            self._lost = f"{self._where()} unreachable: {_first_line(e)}"
        except ray.exceptions.ActorDiedError as e:
            if getattr(e, "preempted", False):
                self._lost = f"{self._where()} preempted"
            self._died = not getattr(e, "actor_init_failed", False)
            self._error = f"{type(e).__name__}: {_first_line(e)}"
        except Exception as e:  # noqa: BLE001 - any other failure of the call is a death all the same
            self._error = f"{type(e).__name__}: {_first_line(e)}"
        finally:
            with self._lock:
                self._open = False
                self._writer.close()
                os.close(self._ended_w)

    def _where(self) -> str:
        if self.meta is None:
            return "its node"
        return f"node {self.meta['address']} ({self.meta['node_id'][:12]})"

    def lost(self) -> str | None:
        """How its node was lost, if it was: Ray said so, or the actor's process died and its
        node does not answer (when a node goes, Ray may report its actors dead before it
        reports the node unreachable)."""
        if self._lost is None and self._died:
            if self.meta is None:
                self._lost = "its driver actor died before it started"
            elif not self._node_answers():
                self._lost = f"{self._where()} did not answer after its driver died"
        return self._lost

    def relaunch_ready(self) -> Callable[[], bool]:
        """When the trial may run again after `lost()`: once Ray has declared the lost node
        dead (a trial actor placed before that could land on it again), or VERDICT_WAIT_S
        after the loss at the latest."""
        node = self.meta["node_id"] if self.meta is not None else None
        deadline = time.monotonic() + VERDICT_WAIT_S

        def ready() -> bool:
            return node is None or time.monotonic() > deadline or not node_alive(node)
        return ready

    def _node_answers(self) -> bool:
        if not node_alive(self.meta["node_id"]):
            return False
        strategy = NodeAffinitySchedulingStrategy(self.meta["node_id"], soft=False)
        ref = ray.remote(_answer).options(num_cpus=0, max_retries=0, scheduling_strategy=strategy).remote()
        try:
            ray.get(ref, timeout=NODE_ANSWER_S)
            return True
        except Exception:  # noqa: BLE001 - unschedulable there, or no answer in time: lost
            ray.cancel(ref, force=True)
            return False

    def signal(self, signum: int) -> None:
        """SIGTERM or SIGINT to the trial's process, through its actor; a trial not started
        yet is killed (it has nothing to checkpoint)."""
        if self.meta is None:
            self.kill()
            return
        self.actor.signal.remote(signum)

    def kill(self) -> None:
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def join(self) -> None:
        """Wait until Ray has said how the call ended, then end the actor's process."""
        select.select([self.sentinel], [], [], JOIN_WAIT_S)
        self.kill()
        os.close(self.sentinel)

    def died(self) -> str:
        return f"the trial's driver on {self._where()} ended without reporting an outcome: {self._error}"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__

