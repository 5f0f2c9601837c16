"""How many more workers the Ray cluster could place now, for elastic runs
(`unbroken.execution.elastic`).

Counted from the nodes Ray reports alive, and from what each has free: a lost node's
resources, which Ray may go on counting until its health checks give up on it, are left out
as soon as the controller has seen it lose ranks, a node drained for preemption (it refuses
new actors) too, and so are the slots that placement groups still pending are about to take.
"""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor

import ray
from ray._private import state as ray_state
from ray.util import placement_group_table

from unbroken.core.config import ScalingConfig
from unbroken.execution.engine.local import start_method
from unbroken.execution.engine.ray import PLACEMENT_TIMEOUT_S
from unbroken.execution.engine.ray_actor import connect
from unbroken.execution.engine.ray_placement import rank_bundle


class RayCapacity:
    """The elastic controller's capacity probe on the Ray engine (`elastic.CapacityProbe`)."""

    def __init__(self, scaling: ScalingConfig) -> None:
        self.bundle = rank_bundle(scaling)
        self.timeout_s = PLACEMENT_TIMEOUT_S

    def __call__(self, lost_nodes: set[str], limit: int) -> int:
        connect()
        alive = {node["NodeID"] for node in ray.nodes() if node.get("Alive")} - lost_nodes
        alive -= set(ray_state.state.get_draining_nodes())
        free = ray_state.available_resources_per_node()
        slots = sum(self._fit(free[node]) for node in alive if node in free)
        return max(0, min(slots - self._pending(), limit))

    @staticmethod
    def _pending() -> int:
        """Bundles of placement groups not placed yet: another run (a sibling trial, say) that was
        sized a moment ago and whose workers are about to take what looks free now."""
        groups = placement_group_table().values()
        return sum(len(pg["bundles"]) for pg in groups if pg["state"] == "PENDING")

    def slots(self) -> int:
        """The worker slots of every live node, free or not."""
        connect()
        return sum(self._fit(node["Resources"]) for node in ray.nodes() if node.get("Alive"))

    def _fit(self, resources: dict[str, float]) -> int:
        """How many workers `resources` (one node's) have room for."""
        return min(int(resources.get(k, 0.0) / need + 1e-9) for k, need in self.bundle.items())


def cluster_slots(scaling: ScalingConfig) -> int:
    """The worker slots of `scaling` on every live node of the cluster, free or not. Asked
    from a short-lived child process unless this one is attached to Ray already: attaching
    starts threads, after which this process (a sweep's driver) could no longer fork."""
    if ray.is_initialized():
        return RayCapacity(scaling).slots()
    context = mp.get_context("fork" if start_method() == "fork" else "spawn")
    with ProcessPoolExecutor(1, mp_context=context) as child:
        return child.submit(_slots, scaling).result()


def _slots(scaling: ScalingConfig) -> int:
    return RayCapacity(scaling).slots()
