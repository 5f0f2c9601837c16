"""Engines run a group of worker processes for the controller. The controller, storage
and restore rules are the same whichever engine runs the workers."""

from __future__ import annotations

import os

from unbroken.config import ScalingConfig
from unbroken.errors import InsufficientResourcesError


def resolve_engine(scaling: ScalingConfig) -> str:
    """The engine `scaling.engine` means here ("auto": local unless a Ray cluster is configured);
    raises for one this version cannot run."""
    engine = scaling.engine
    if engine == "auto":
        engine = "ray" if os.environ.get("RAY_ADDRESS") else "local"
    if engine == "ray":
        raise NotImplementedError(
            "the Ray engine is not available in this version of unbroken. Hint: use "
            "ScalingConfig(engine='local'), or unset RAY_ADDRESS to run on this machine")
    return engine


def check_can_run(scaling: ScalingConfig) -> None:
    """Raise before anything is written when the engine cannot run `scaling` here: an engine
    this version lacks, or GPUs asked for where none is visible."""
    resolve_engine(scaling)
    if scaling.use_gpu:
        from unbroken.engine.local import visible_gpus

        count, how = visible_gpus()
        if count < 1:
            raise InsufficientResourcesError(
                f"ScalingConfig(use_gpu=True) asks for GPUs, but no GPU is visible on this machine "
                f"({how}). Hint: use ScalingConfig(use_gpu=False) to train on the CPU, or run on a "
                "machine with a CUDA GPU (and check CUDA_VISIBLE_DEVICES)")


def make_worker_group(scaling: ScalingConfig):
    """The worker group that runs the workers for `scaling`."""
    resolve_engine(scaling)
    from unbroken.engine.local import LocalWorkerGroup

    return LocalWorkerGroup(scaling.num_workers)
