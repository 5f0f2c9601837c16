"""Where the Ray engine's ranks go (unbroken.execution.engine.ray): the resources one rank's
bundle in the placement group asks for, what the cluster lacks when the group cannot be
placed, and how ranks are numbered across nodes once their actors are placed.

Kept apart from the worker group (RayWorkerGroup) because none of it starts actors, holds
connections or keeps state: it only reads Ray's resource figures and the actors' metadata.
"""

from __future__ import annotations

from typing import Any

import ray

from unbroken.core.config import ScalingConfig


def rank_bundle(scaling: ScalingConfig) -> dict[str, float]:
    """The resources one rank asks for: 1 CPU unless resources_per_worker says otherwise, a GPU
    with use_gpu, and the accelerator type when one is named."""
    bundle = {"CPU": 1.0, **(scaling.resources_per_worker or {})}
    if scaling.use_gpu:
        bundle.setdefault("GPU", 1.0)
    if scaling.accelerator_type:
        bundle[f"accelerator_type:{scaling.accelerator_type}"] = 0.001
    return {k: float(v) for k, v in bundle.items() if v}


def missing_resources(bundle: dict[str, float], n: int, strategy: str) -> str:
    """What the cluster lacks for `n` bundles, as a sentence for the error."""
    total = ray.cluster_resources()
    free = ray.available_resources()
    need = {k: v * n for k, v in bundle.items()}
    short = [f"{k}: {need[k]:g} needed, {total.get(k, 0):g} in the cluster ({free.get(k, 0):g} free)"
             for k in sorted(need) if total.get(k, 0) < need[k] or free.get(k, 0) < need[k]]
    nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    if not short:
        short = [f"the cluster has the resources in total, but not in the shape {strategy} asks "
                 f"for ({n} bundles of {bundle} on {nodes} live nodes)"]
    return "; ".join(short)


def rank_order(metas: list[dict[str, Any]]) -> list[tuple[int, int, int, int]]:
    """(bundle index, node rank, local rank, local world size) for each rank, ranks grouped by
    node (the nodes in the order of their first bundle) so that neighbours share a node."""
    nodes: dict[str, list[int]] = {}
    for index, meta in enumerate(metas):
        nodes.setdefault(meta["node_id"], []).append(index)
    return [(index, node_rank, local_rank, len(indices))
            for node_rank, indices in enumerate(nodes.values())
            for local_rank, index in enumerate(indices)]
