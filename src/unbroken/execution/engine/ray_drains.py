"""Preemption on the Ray engine (see `unbroken.execution.notices`): the nodes Ray drains, and
giving a rank's step up on its node.

A node drained for preemption (the autoscaler's or KubeRay's spot reclaim, `ray drain-node`,
a SIGTERM to `ray start --block`) runs on until its deadline; it refuses new actors, so the
next attempt is placed elsewhere. Ray kills nothing at the deadline: the cloud removes the
machine then.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from unbroken.worker import preemption


def draining(metas: list[dict[str, Any]]) -> dict[str, tuple[float | None, list[int]]]:
    """The drained nodes that run ranks (`metas`: each rank's actor's, by rank): node id ->
    (its deadline in time.time() seconds, None when the drain has none; the ranks on it)."""
    drains = ray._private.state.state.get_draining_nodes()  # {node id: deadline ms, 0: none}
    out: dict[str, tuple[float | None, list[int]]] = {}
    for rank, meta in enumerate(metas):
        if meta["node_id"] in drains:
            ms = drains[meta["node_id"]]
            out.setdefault(meta["node_id"], (ms / 1000 if ms else None, []))[1].append(rank)
    return out


def interrupt(metas: list[dict[str, Any]], ranks: set[int]) -> None:
    """Give the ranks' steps up by a task on each one's node (not waited for)."""
    for rank in ranks:
        meta = metas[rank]
        ray.remote(abandon_step).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
            meta["node_id"], soft=False)).remote(meta["pid"])


def abandon_step(pid: int) -> None:
    """Give up the step of the rank in process `pid` (`worker.preemption`)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, preemption.ABANDON_SIGNAL)
