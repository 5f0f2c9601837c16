"""The Ray engine: one Ray actor per rank, gang-scheduled in a placement group across the
nodes of a Ray cluster.

Ray places, starts and kills the ranks, and tells when one is lost. Messages do not go
through Ray: each rank opens one TCP connection to the driver, authenticated with a secret
drawn for the attempt (`multiprocessing.connection`'s HMAC challenge: the secret never
crosses the network, and nothing is unpickled from a peer that has not proved it holds it).
The controller's messages travel on it as on the local engine's pipes, so a report costs one
small message each way (a fraction of a millisecond) instead of Ray calls.

Lifetimes: actors are never detached, so Ray kills them when the driver dies; `shutdown`
kills them and removes the placement group (unless the next attempt takes it over warm: see
`engine.ray_spares`). How the group learns that a rank was lost, and why: `engine.ray_deaths`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import selectors
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import (
    Connection,
)
from typing import Any

import ray
import ray.exceptions
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from unbroken.core import shipping
from unbroken.core.config import ScalingConfig
from unbroken.errors import InsufficientResourcesError, VersionMismatchError, WorkerDied
from unbroken.execution.engine import ray_drains
from unbroken.execution.engine.base import Event, Placement, Wakeup, renumbered
from unbroken.execution.engine.ray_actor import RankActor, connect, kill_actors, sigkill, versions
from unbroken.execution.engine.ray_deaths import RankDeaths, lost_with_node
from unbroken.execution.engine.ray_link import HANDSHAKE_S, Listener
from unbroken.execution.engine.ray_placement import missing_resources, rank_bundle, rank_order
from unbroken.execution.engine.ray_spares import WARM_WAIT_S, Spares, match
from unbroken.worker import stacks
from unbroken.worker.protocol import from_wire, to_wire
from unbroken.worker.recovery.messages import Rejoin

# How long the placement group may take to be placed (all ranks or none), and the actors to
# start and connect. Env vars, as Ray Train's own timeouts are.
PLACEMENT_TIMEOUT_S = float(os.environ.get("UNBROKEN_RAY_PLACEMENT_TIMEOUT_S", "60"))
START_TIMEOUT_S = float(os.environ.get("UNBROKEN_RAY_START_TIMEOUT_S", "300"))
# How often an idle poll asks Ray whether a rank's call ended (a lost node whose connection
# does not close); a closed connection is looked into at once.
CHECK_S = 0.25


class RayWorkerGroup:
    """Ranks as Ray actors in one placement group: a `WorkerGroup` (engine.base), with warm
    restarts on spare actors (`warm_up`, `keep_warm`: see engine.ray_spares)."""

    spans_machines = True

    def __init__(self, scaling: ScalingConfig, warm: RayWorkerGroup | None = None) -> None:
        self.scaling = scaling
        self.num_workers = scaling.num_workers
        self.pg: Any = None
        self.actors: list[Any] = []   # by rank
        self.spares = Spares()        # by bundle, after warm_up
        self.refs: list[Any] = []     # each rank's running `run` call
        self.metas: list[dict[str, Any]] = []
        self.placements: list[Placement] = []  # by rank, once started
        self.conns: list[Connection | None] = []
        self._warm = warm
        self._bundles: list[int] = []  # each rank's bundle in the placement group
        self._selector = selectors.DefaultSelector()
        self._wake: Wakeup | None = None
        self._listener: Listener | None = None
        self._deaths = RankDeaths()
        self._idle: set[int] = set()  # bundles of dropped ranks (`drop`)
        self._checked = 0.0

    # -- start -----------------------------------------------------------------------------
    def start(self, payload: Callable[[Placement], Any]) -> list[Placement]:
        connect()
        taken = self._take_warm()
        by_bundle, metas = taken if taken is not None else self._place()
        mine = versions()
        for meta in metas:
            if meta["versions"] != mine:
                raise VersionMismatchError(
                    f"node {meta['address']} runs {meta['versions']}, the driver {mine}: a worker "
                    "there could not load what the driver sends. Hint: install the same versions "
                    "of Python, torch and unbroken on every node")
        cpus = max(1, int(rank_bundle(self.scaling).get("CPU", 1)))
        placements = []
        self.actors, self.metas, self._bundles = [], [], []
        for rank, (index, node_rank, local_rank, local_size) in enumerate(rank_order(metas)):
            self.actors.append(by_bundle[index])
            self.metas.append(metas[index])
            self._bundles.append(index)
            placements.append(Placement(
                rank=rank, node_rank=node_rank, local_rank=local_rank, local_world_size=local_size,
                node_id=metas[index]["node_id"], node_address=metas[index]["address"], cpus=cpus))
        self._launch(payload, placements)
        self.placements = placements
        return placements

    def _place(self) -> tuple[list[Any], list[dict[str, Any]]]:
        """A new placement group and one actor per bundle: (actors by bundle, their metas)."""
        self._reserve()
        self.actors = [self._actor(i) for i in range(self.num_workers)]  # shutdown kills them all
        return self.actors, ray.get([a.meta.remote() for a in self.actors], timeout=START_TIMEOUT_S)

    def _reserve(self) -> None:
        """Place a new placement group of one bundle per rank, or raise naming what is missing."""
        n, strategy = self.num_workers, self.scaling.placement_strategy
        bundle = rank_bundle(self.scaling)
        self.pg = placement_group([bundle] * n, strategy=strategy)
        try:
            ray.get(self.pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise InsufficientResourcesError(
                f"the Ray cluster could not place {n} workers ({strategy}, each {bundle}) within "
                f"{PLACEMENT_TIMEOUT_S:g} s: {missing_resources(bundle, n, strategy)}. Hint: add nodes, or "
                "lower ScalingConfig(num_workers=..., resources_per_worker=...), or use "
                "placement_strategy='PACK' (UNBROKEN_RAY_PLACEMENT_TIMEOUT_S sets the wait)") from None

    def _actor(self, index: int) -> Any:
        """A new rank actor in bundle `index` of the placement group, holding the bundle's resources."""
        resources = rank_bundle(self.scaling)
        gpus, cpus = resources.pop("GPU", 0), resources.pop("CPU", 0)
        return ray.remote(RankActor).options(
            num_cpus=cpus, num_gpus=gpus, resources=resources, max_restarts=0, max_concurrency=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index),
        ).remote()

    def _take_warm(self) -> tuple[list[Any], list[dict[str, Any]]] | None:
        """Actors by bundle, and their metas, from the previous group's spares: in its placement
        group when this group has the same size and it was not released, else in a new one,
        each bundle taking a spare on its node (a new actor where there is none). None when
        there is nothing warm, or a spare taken does not answer."""
        old, self._warm = self._warm, None
        if old is None or not old.spares.complete():  # none, or one taken by a rejoin
            return None
        spares, nodes = old.spares.take_all()
        self.actors = spares  # from here on, this group's to release
        if old.pg is not None and old.num_workers == self.num_workers:
            self.pg, old.pg = old.pg, None  # spare i sits on the node of bundle i
        else:
            old._release()
            self._reserve()
            placed = ray.util.placement_group_table(self.pg)["bundles_to_node_id"]
            self.actors = match(spares, nodes, placed, self.num_workers, self._actor)
        try:
            return self.actors, ray.get([a.meta.remote() for a in self.actors], timeout=WARM_WAIT_S)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            self._release()
            return None

    def warm_up(self) -> None:
        """One spare per bundle (again for those a `rejoin` took)."""
        if self.spares.complete() or self.pg is None or self.scaling.use_gpu or self._idle:
            return  # after a `drop`, a restart places a group of its own size
        nodes = [self.metas[self._bundles.index(i)]["node_id"] for i in range(self.num_workers)]
        self.spares.start(nodes, self.num_workers > 1)

    def release_placement(self) -> None:
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.pg = None

    def _launch(self, payload: Callable[[Placement], Any], placements: list[Placement]) -> None:
        """Start every rank's `run` and wait until each has connected (or one failed)."""
        self._listener = Listener(ray.util.get_node_ip_address(), secrets.token_bytes(32))
        self.refs, self.conns = [None] * self.num_workers, [None] * self.num_workers
        self._run(payload, placements)

    def _run(self, payload: Callable[[Placement], Any], placements: list[Placement]) -> None:
        """Start the `run` of the ranks at `placements` and wait until each has connected (or
        one failed)."""
        for p in placements:
            blob, apart = shipping.dumps(payload(p))
            shipped = {token: ray.put(dataset) for token, dataset in apart.items()}
            self.refs[p.rank] = self.actors[p.rank].run.remote(
                blob, p.rank, self._listener.address, self._listener.authkey, list(sys.path), shipped)
        waiting = selectors.DefaultSelector()
        waiting.register(self._listener, selectors.EVENT_READ)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while any(c is None for c in self.conns):
                if time.monotonic() > deadline:
                    raise InsufficientResourcesError(
                        f"the workers did not connect to the driver at {self._listener.address} within "
                        f"{START_TIMEOUT_S:g} s. Hint: the driver's address must be reachable from "
                        "every node (UNBROKEN_RAY_START_TIMEOUT_S sets the wait)")
                if waiting.select(CHECK_S):
                    self._greet()
                waiting_for = [ref for rank, ref in enumerate(self.refs) if self.conns[rank] is None]
                ended, _ = ray.wait(waiting_for, num_returns=len(waiting_for), timeout=0)
                for ref in ended:
                    # Raises the rank's error (an import that fails on the node, ...). A rank that
                    # returned had connected first (it may fail fast, e.g. on the storage probe):
                    # its connection waits to be accepted, with its messages.
                    ray.get(ref)
        finally:
            waiting.close()
        for p in placements:
            self._selector.register(self.conns[p.rank], selectors.EVENT_READ, p.rank)

    can_rejoin = True

    def rejoin(self, payload: Callable[[Placement], Any], replaced: set[int]) -> list[Placement]:
        """The next attempt on the ranks that stayed (a `Rejoin` over their connection); each
        rank in `replaced` is killed and started again in its bundle, on its spare when the
        group kept one warm, else on a new actor (always after its node was lost: Ray places
        the bundle on another node, see `_moved`)."""
        self._deaths = RankDeaths()
        for rank in sorted(replaced):
            conn, self.conns[rank] = self.conns[rank], None
            if conn is not None:
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(conn)
                conn.close()
            kill_actors([self.actors[rank]])
            bundle = self._bundles[rank]
            spare = self.spares.take(bundle)
            moved = lost_with_node(rank, self.refs[rank], self.metas[rank])
            if moved:
                kill_actors([spare])  # it was on the lost node too
                spare = None
            self.actors[rank] = spare if spare is not None else self._actor(bundle)
            if moved:
                self._moved(rank)
        for rank in range(self.num_workers):
            if rank not in replaced:
                self.send(rank, Rejoin(shipping.dumps(payload(self.placements[rank]))[0]))
        self._run(payload, [self.placements[rank] for rank in sorted(replaced)])
        return self.placements

    def drop(self, ranks: set[int]) -> None:
        for rank in ranks:
            kill_actors([self.actors[rank]])
            self._idle.add(self._bundles[rank])
        for conn in self.conns:
            if conn is not None:
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(conn)
        for rank in ranks:
            if self.conns[rank] is not None:
                self.conns[rank].close()
        order = [rank for rank in range(self.num_workers) if rank not in ranks]
        for name in ("actors", "refs", "metas", "conns", "_bundles"):
            setattr(self, name, [getattr(self, name)[rank] for rank in order])
        self.placements, self.num_workers = renumbered(self.placements, order), len(order)
        for rank, conn in enumerate(self.conns):
            if conn is not None:
                self._selector.register(conn, selectors.EVENT_READ, rank)

    def idle_slots(self) -> int:
        """The bundles of dropped ranks that Ray has placed again, on a live node."""
        if not self._idle or self.pg is None:
            return 0
        placed = ray.util.placement_group_table(self.pg).get("bundles_to_node_id", {})
        alive = {node["NodeID"] for node in ray.nodes() if node.get("Alive")}
        return sum(1 for bundle in self._idle if placed.get(bundle) in alive)

    def _moved(self, rank: int) -> None:
        """Rank `rank`'s node was lost: its new actor starts once Ray has placed its bundle on a
        live node (within START_TIMEOUT_S); the rank's placement follows it there, after the
        ranks already on that node."""
        meta = ray.get(self.actors[rank].meta.remote(), timeout=START_TIMEOUT_S)
        old, self.metas[rank] = self.placements[rank], meta
        there = [p for p in self.placements if p.rank != rank and p.node_id == meta["node_id"]]
        self.placements[rank] = dataclasses.replace(
            old, node_rank=there[0].node_rank if there else old.node_rank, local_rank=len(there),
            local_world_size=len(there) + 1, node_id=meta["node_id"], node_address=meta["address"])

    def kill(self, rank: int) -> None:
        """SIGKILL the rank's process by a task on its node (`ray.kill` first asks the actor to
        exit, which a stopped process never does), then end its actor."""
        meta = self.metas[rank]
        task = ray.remote(sigkill).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
            meta["node_id"], soft=False))
        with contextlib.suppress(Exception):  # its node is gone, with it
            ray.get(task.remote(meta["pid"]), timeout=10)
        kill_actors([self.actors[rank]])

    def interrupt(self, ranks: set[int]) -> None:
        ray_drains.interrupt(self.metas, ranks)

    def draining(self) -> dict[str, tuple[float | None, list[int]]]:
        return ray_drains.draining(self.metas)

    def _greet(self) -> None:
        conn = self._listener.accept()
        if conn is None or not conn.poll(HANDSHAKE_S):
            return
        kind, rank = conn.recv()
        if kind == "hello" and 0 <= rank < self.num_workers and self.conns[rank] is None:
            self.conns[rank] = conn
        else:
            conn.close()

    # -- running ---------------------------------------------------------------------------
    def send(self, rank: int, message: Any) -> None:
        conn = self.conns[rank]
        if conn is None or rank in self._deaths.ended:
            return
        try:
            conn.send(to_wire(message))
        except OSError:
            pass  # its death is reported by poll()

    def poll(self, timeout: float, wake: Wakeup | None = None) -> list[Event]:
        if wake is not None and wake is not self._wake:
            self._selector.register(wake, selectors.EVENT_READ, wake)
            self._wake = wake
        out = self._deaths.due()
        closed = []
        for key, _ in self._selector.select(0 if out else min(timeout, CHECK_S)):
            if key.data is self._wake:
                self._wake.drain()
                continue
            rank = key.data
            messages, eof = self._read(rank)
            out.extend((rank, m) for m in messages)
            if eof:
                closed.append(rank)
        now = time.monotonic()
        if closed or now - self._checked >= CHECK_S:
            self._checked = now
            self._deaths.look(self.refs, self.metas, closed, out)
        return out

    def _read(self, rank: int) -> tuple[list[Any], bool]:
        """Every message waiting on `rank`'s connection, and whether it closed."""
        conn, out = self.conns[rank], []
        try:
            while conn.poll():
                out.append(from_wire(conn.recv()))
        except (EOFError, OSError):
            self._selector.unregister(conn)
            return out, True
        return out, False

    def mark_finished(self, rank: int) -> None:
        self._deaths.finished.add(rank)

    def stacks(self, wait_s: float) -> dict[int, str | None]:
        """Each rank's stacks, dumped by a task on its node (the signal reaches only there); None
        for a rank whose node does not run the task in time (frozen, or gone)."""
        dump = ray.remote(stacks.dump)
        refs = [dump.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
                    meta["node_id"], soft=False)).remote(meta["pid"], wait_s) for meta in self.metas]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s + 10)
        texts: dict[int, str | None] = {}
        for rank, ref in enumerate(refs):
            try:
                texts[rank] = ray.get(ref, timeout=0) if ref in ready else None
            except Exception:  # noqa: BLE001 - its node failed the task: no stacks rather than no restart
                texts[rank] = None
        return texts

    def lost_ranks(self, wait_s: float) -> list[WorkerDied]:
        return self._deaths.lost(self.refs, self.metas, wait_s)

    def shutdown(self, kill: bool = False, keep_warm: bool = False) -> None:
        if self.refs and not kill:
            ray.wait(self.refs, num_returns=len(self.refs), timeout=5)
        kill_actors(self.actors)
        self.actors, self.refs = [], []
        if not (keep_warm and self.spares.actors):
            self._release()
        for conn in self.conns:
            if conn is not None:
                conn.close()
        if self._listener is not None:
            self._listener.close()
        self._selector.close()
        self.conns, self._listener = [], None

    def _release(self) -> None:
        """Kill the actors and spares, and give the placement group's resources back."""
        kill_actors(self.actors)
        self.spares.kill()
        self.actors = []
        self.release_placement()
