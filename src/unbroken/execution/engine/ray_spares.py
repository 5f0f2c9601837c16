"""Warm restarts on the Ray engine (unbroken.execution.engine.ray): spare rank actors that the
next worker group starts its ranks on.

Once the ranks are in their loop and a failure would be retried, the group's `warm_up`
starts one spare actor per bundle, on the bundle's node but outside the placement group (no
resources of its own), which imports torch and torch._dynamo and waits. After a failure the
group is shut down with `keep_warm`. The next group of the same size keeps the placement
group and starts its ranks on the spares; after `release_placement` (an elastic run changing
size, or a lost node) it places a new group, and each rank whose bundle lands on a node with
a spare starts on it (`match`). A spare that is gone (its node was lost) is not waited for;
with GPUs (a spare has none assigned) every group starts cold.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from unbroken.execution.engine.ray_actor import RankActor, kill_actors

# How long a restart waits for the spares to finish warming up (each imports torch once).
WARM_WAIT_S = 60.0


class Spares:
    """A worker group's spare actors, by bundle, and the node each one is on."""

    def __init__(self) -> None:
        self.actors: list[Any] = []  # by bundle; None where a `rejoin` took one
        self.nodes: list[str] = []   # by bundle

    def complete(self) -> bool:
        """Whether every bundle has its spare (none, or one taken by a rejoin: not warm)."""
        return bool(self.actors) and None not in self.actors

    def start(self, nodes: list[str], distributed: bool) -> None:
        """A spare on the node of each bundle (`nodes`, by bundle) that has none. Outside the
        placement group: a spare outlives the group when it is released (another size, a lost
        node) and serves the next one on its node."""
        self.nodes = nodes
        self.actors = self.actors or [None] * len(nodes)
        for i, node in enumerate(nodes):
            if self.actors[i] is None:
                self.actors[i] = ray.remote(RankActor).options(
                    num_cpus=0, max_restarts=0, max_concurrency=1,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
                self.actors[i].warm.remote(distributed)

    def take(self, bundle: int) -> Any | None:
        """The spare of `bundle`, or None; taken, it leaves the group no longer warm for a restart."""
        spare = self.actors[bundle] if self.actors else None
        if spare is not None:
            self.actors[bundle] = None
        return spare

    def take_all(self) -> tuple[list[Any], list[str]]:
        """Every spare and its node, handed to the next group (which releases them from then on)."""
        actors, self.actors = self.actors, []
        return actors, self.nodes

    def kill(self) -> None:
        kill_actors(self.actors)
        self.actors = []


def match(spares: list[Any], nodes: list[str], placed: dict[int, str], count: int,
          new_actor: Callable[[int], Any]) -> list[Any]:
    """One actor for each of the `count` bundles of a new placement group (`placed`: each
    bundle's node): a spare on the bundle's node where there is one, else `new_actor(bundle)`.
    The spares left over are killed."""
    pool: dict[str, list[Any]] = {}
    for spare, node in zip(spares, nodes, strict=True):
        pool.setdefault(node, []).append(spare)
    actors = [pool[placed[i]].pop() if pool.get(placed[i]) else new_actor(i) for i in range(count)]
    kill_actors([spare for left in pool.values() for spare in left])
    return actors
