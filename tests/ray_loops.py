"""Training functions for the Ray engine's tests (importable: workers load them by reference)."""

from __future__ import annotations

import json
import os
import sys

import ray

from loops import linear_loop
from unbroken import train


def placed_loop(config: dict) -> None:
    """`linear_loop`, after each rank wrote where it runs to `<dir>/rank<r>-a<attempt>.json`."""
    ctx = train.get_context()
    rank, attempt = ctx.get_world_rank(), ctx.get_attempt()
    where = {"rank": rank, "node_rank": ctx.get_node_rank(), "local_rank": ctx.get_local_rank(),
             "local_world_size": ctx.get_local_world_size(), "pid": os.getpid(),
             "node_id": ray.get_runtime_context().get_node_id(), "attempt": attempt,
             "warm": "torch._dynamo" in sys.modules}  # imported before DDP: a warm spare
    with open(os.path.join(config["dir"], f"rank{rank}-a{attempt}.json"), "w") as f:
        json.dump(where, f)
    linear_loop(config)


def pinned_loop(config: dict) -> None:
    """`linear_loop`, whose fault knobs act only on a worker that holds the custom resource
    `config["faults_on"]` (a node's name): a sweep's trials pinned to different nodes share
    one config."""
    if config.get("faults_on") not in ray.get_runtime_context().get_assigned_resources():
        config = {key: value for key, value in config.items() if not key.endswith("_at")}
    linear_loop(config)
