"""Engines run a group of worker processes for the controller. The controller, storage
and restore rules are the same whichever engine runs the workers: `engine.local` (processes
on this machine) and `engine.ray` (actors on the nodes of a Ray cluster)."""

from __future__ import annotations

import importlib.util
import os
import sys

from unbroken.core.config import ScalingConfig
from unbroken.errors import InsufficientResourcesError, MissingDependencyError


def ray_is_configured() -> bool:
    """A Ray cluster is configured for this process: RAY_ADDRESS is set, or the driver already
    called `ray.init()` (checked without importing ray)."""
    if os.environ.get("RAY_ADDRESS"):
        return True
    ray = sys.modules.get("ray")
    return ray is not None and bool(getattr(ray, "is_initialized", lambda: False)())


def engine_env() -> dict[str, str]:
    """What a process this driver starts (a sweep's trial) needs in its environment to reach
    the same engine: the Ray cluster's address when this driver joined one by `ray.init(...)`
    rather than through RAY_ADDRESS."""
    if os.environ.get("RAY_ADDRESS") or not ray_is_configured():
        return {}
    from unbroken.execution.engine.ray_actor import cluster_address

    return {"RAY_ADDRESS": cluster_address()}


def resolve_engine(scaling: ScalingConfig) -> str:
    """The engine `scaling.engine` means here ("auto": Ray when a Ray cluster is configured,
    else local); raises MissingDependencyError for the Ray engine without ray installed."""
    engine = scaling.engine
    if engine == "auto":
        engine = "ray" if ray_is_configured() else "local"
    if engine == "ray" and importlib.util.find_spec("ray") is None:
        raise MissingDependencyError(
            "ScalingConfig(engine='ray') (or RAY_ADDRESS with engine='auto') needs Ray, which is not "
            "installed. Hint: pip install 'unbroken[ray]', or use ScalingConfig(engine='local')")
    return engine


def check_can_run(scaling: ScalingConfig) -> None:
    """Raise before anything is written when the engine cannot run `scaling` here: Ray asked for
    but not installed, or GPUs asked for on the local engine where none is visible (on Ray,
    the cluster's resources decide, when the workers are placed)."""
    if resolve_engine(scaling) == "local" and scaling.use_gpu:
        from unbroken.execution.engine.local import visible_gpus

        count, how = visible_gpus()
        if count < 1:
            raise InsufficientResourcesError(
                f"ScalingConfig(use_gpu=True) asks for GPUs, but no GPU is visible on this machine "
                f"({how}). Hint: use ScalingConfig(use_gpu=False) to train on the CPU, or run on a "
                "machine with a CUDA GPU (and check CUDA_VISIBLE_DEVICES)")


def capacity_probe(scaling: ScalingConfig):
    """How an elastic run of `scaling` learns how many workers could be placed now (see
    `elastic.CapacityProbe`); None on the local engine, where every attempt gets max_workers."""
    if resolve_engine(scaling) == "ray":
        from unbroken.execution.engine.ray_capacity import RayCapacity

        return RayCapacity(scaling)
    return None


def cluster_slots(scaling: ScalingConfig) -> int | None:
    """How many workers of `scaling` the engine's machines hold in all, free or not: on the
    Ray engine the live nodes' worker slots; None on the local engine (no fixed count)."""
    if resolve_engine(scaling) == "ray":
        from unbroken.execution.engine.ray_capacity import cluster_slots as ray_slots

        return ray_slots(scaling)
    return None


def make_worker_group(scaling: ScalingConfig, warm=None):
    """A new worker group for one attempt of a run with `scaling`; `warm`: the previous
    attempt's group, which warmed up for this restart (see `engine.base.WorkerGroupFactory`)."""
    if resolve_engine(scaling) == "ray":
        from unbroken.execution.engine.ray import RayWorkerGroup

        return RayWorkerGroup(scaling, warm)
    from unbroken.execution.engine import kept_group
    from unbroken.execution.engine.local import LocalWorkerGroup

    kept = kept_group.take(scaling.num_workers, scaling.cpus_per_worker())
    return kept or LocalWorkerGroup(scaling.num_workers, scaling.cpus_per_worker(), warm is not None)

