"""How many more workers the Ray cluster could place now, for elastic runs
(`unbroken.execution.elastic`).

Counted from the nodes Ray reports alive, and from what each has free: a lost node's
resources, which Ray may go on counting until its health checks give up on it, are left out
as soon as the controller has seen it lose ranks.
"""

from __future__ import annotations

import ray
from ray._private import state as ray_state

from unbroken.core.config import ScalingConfig
from unbroken.execution.engine.ray import PLACEMENT_TIMEOUT_S, connect
from unbroken.execution.engine.ray_placement import rank_bundle


class RayCapacity:
    """The elastic controller's capacity probe on the Ray engine (`elastic.CapacityProbe`)."""

    def __init__(self, scaling: ScalingConfig) -> None:
        self.bundle = rank_bundle(scaling)
        self.timeout_s = PLACEMENT_TIMEOUT_S

    def __call__(self, lost_nodes: set[str], limit: int) -> int:
        connect()
        alive = {node["NodeID"] for node in ray.nodes() if node.get("Alive")} - lost_nodes
        slots = 0
        for node, free in ray_state.available_resources_per_node().items():
            if node in alive:
                slots += min(int(free.get(k, 0.0) / need + 1e-9) for k, need in self.bundle.items())
        return min(slots, limit)
