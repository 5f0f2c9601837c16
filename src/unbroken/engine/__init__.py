"""Engines run a group of worker processes for the controller. The controller, storage
and restore rules are the same whichever engine runs the workers."""

from __future__ import annotations

import os

from unbroken.config import ScalingConfig


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


def make_worker_group(scaling: ScalingConfig):
    """The worker group that runs the workers for `scaling`."""
    resolve_engine(scaling)
    from unbroken.engine.local import LocalWorkerGroup

    return LocalWorkerGroup(scaling.num_workers)
