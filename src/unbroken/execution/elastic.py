"""Elastic sizing: how many workers each attempt of an elastic run gets, and when it grows.

An elastic run (`ScalingConfig(num_workers=(min_workers, max_workers))`) trains on as many
workers as the engine can place, between the two bounds:

- an attempt starts with `min(capacity, max_workers)` workers once that is at least
  `min_workers` (a first start waits a little for more); below it, the controller waits for
  capacity (`wait_for_capacity`), as long as a fixed-size run waits to be placed;
- after a failure the next attempt is sized the same way, from what is alive then, so a
  lost node shrinks the run at once instead of waiting for a replacement;
- while an attempt trains, at most every `interval_s` the controller asks whether more
  workers could be placed (`grow_to`); when they can, it takes a checkpoint at the next
  report and restarts larger. A resize is not a failure.

Pure: the capacity (from the engine) and the time are passed in.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from unbroken.core.config import ScalingConfig
from unbroken.errors import InsufficientResourcesError


@dataclass
class ElasticSizing:
    """The sizing rules of one elastic run (see the module docstring)."""

    min_workers: int
    max_workers: int
    interval_s: float
    last_check: float = 0.0  # monotonic time of the last growth check (or of the attempt's start)

    def size(self, capacity: int) -> int | None:
        """The next attempt's size for `capacity` placeable workers, or None below min_workers."""
        n = min(capacity, self.max_workers)
        return n if n >= self.min_workers else None

    def started(self, now: float) -> None:
        """An attempt started: the first growth check is one interval later."""
        self.last_check = now

    def check_due(self, now: float, current: int) -> bool:
        """Whether a growth check is due: the run is below max_workers and an interval passed."""
        return current < self.max_workers and now - self.last_check >= self.interval_s

    def grow_to(self, now: float, current: int, capacity: int) -> int | None:
        """The size to grow to, given `capacity` workers placeable now in all (the current
        ones included), or None to stay. Records the check."""
        self.last_check = now
        n = min(capacity, self.max_workers)
        return n if n > current else None


def wait_for_capacity(sizing: ElasticSizing, capacity: Callable[[], int], *, more_s: float,
                      timeout_s: float, clock: Callable[[], float], sleep: Callable[[float], None],
                      poll_s: float = 0.5, most: int | None = None) -> tuple[int | None, int]:
    """Poll `capacity()` until an attempt can start: at once with `most` workers (default
    max_workers), after `more_s` with at least min_workers (a first start waits that long for
    more; a restart after a failure does not wait); returns (its size, the capacity seen), or
    (None, the last capacity seen) after `timeout_s` below min_workers."""
    most = sizing.max_workers if most is None else most
    start = clock()
    while True:
        seen = capacity()
        n = sizing.size(min(seen, most))
        waited = clock() - start
        if n == most or (n is not None and waited >= more_s) or waited >= timeout_s:
            return n, seen
        sleep(poll_s)


class CapacityProbe(Protocol):
    """The engine's answer to "how many more workers could be placed now": `probe(lost_nodes,
    limit)` counts free worker slots on live nodes (leaving out `lost_nodes`, which the
    controller saw lose ranks even while the engine may still count them), up to `limit`.
    `timeout_s`: how long a run below min_workers waits for capacity."""

    timeout_s: float

    def __call__(self, lost_nodes: set[str], limit: int) -> int: ...


START_WAIT_S = 5.0  # how long a first start with fewer than max_workers waits for more
# How long a restart after a failure on live nodes waits for more than min_workers: the
# failed group's resources take a moment to show as free again.
RESTART_WAIT_S = 1.0


class Unbounded:
    """Every worker can be placed: the local engine (one machine runs any number of worker
    processes, so each attempt gets max_workers) and test groups."""

    timeout_s = 0.0

    def __call__(self, lost_nodes: set[str], limit: int) -> int:
        return limit


class ElasticScaler:
    """The controller's elastic bookkeeping across the attempts of one fit(): the size of
    each attempt and why, the nodes lost, and when to grow."""

    def __init__(self, scaling: ScalingConfig, probe: CapacityProbe,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, start_limit: int | None = None) -> None:
        self.base = scaling
        self.probe = probe
        self.sizing = ElasticSizing(scaling.min_workers, scaling.max_workers,
                                    float(scaling.elastic_resize_monitor_interval_s))
        self.clock, self.sleep = clock, sleep
        self.current: int | None = None  # the size of the latest attempt
        self.reason = "start"
        self.lost_nodes: set[str] = set()
        # At most this many workers for the first attempt: a sweep's share of the cluster for a
        # trial (tune.trial_slots), so that trials started together do not count the same slots.
        self.start_limit = start_limit

    def next_attempt(self, held: int = 0) -> tuple[ScalingConfig, dict[str, Any]]:
        """The next attempt's scaling and its record (Attempt.elastic); `held`: workers the
        run still holds on live nodes (a group kept warm for the restart). Raises
        InsufficientResourcesError when fewer than min_workers can be placed in time."""
        most = self.sizing.max_workers
        if self.current is None and self.start_limit is not None:
            most = max(self.sizing.min_workers, min(most, self.start_limit))
        limit = most - held
        began = self.clock()
        n, seen = wait_for_capacity(
            self.sizing, lambda: held + self.probe(self.lost_nodes, limit),
            more_s=self._wait_for_more(), timeout_s=self.probe.timeout_s,
            clock=self.clock, sleep=self.sleep, most=most)
        if n is None:
            lost = ", ".join(sorted(node[:12] for node in self.lost_nodes))
            raise InsufficientResourcesError(
                f"the elastic run needs at least {self.sizing.min_workers} workers, and only {seen} could "
                f"be placed within {self.probe.timeout_s:g} s (each worker needs {self.base.worker_resources}"
                f"{'; nodes lost: ' + lost if lost else ''}). Hint: add nodes, or lower "
                "ScalingConfig(num_workers=(min_workers, max_workers))")
        record = {"reason": self.reason, "capacity": seen, "previous": self.current,
                  "waited_s": round(self.clock() - began, 3)}
        self.current = n
        self.sizing.started(self.clock())
        return self.base.fixed(n), record

    def size(self, warm: Any, in_place: int | None) -> tuple[ScalingConfig, dict[str, Any]]:
        """The next attempt's scaling and record. Recovering in place (`in_place`: the failed
        attempt's ranks whose nodes are alive), that many, at once, without asking the engine.
        Otherwise from what can be placed now (`next_attempt`), counting what the previous group
        kept warm (`warm`, a WorkerGroup) unless it lost a node (it released its placement
        then); a warm group of another size than the attempt's releases its placement too, and
        the new group starts on its spares where it can."""
        if in_place is not None:
            record = {"reason": self.reason, "capacity": in_place, "previous": self.current, "waited_s": 0.0}
            self.current = in_place
            self.sizing.started(self.clock())
            return self.base.fixed(in_place), record
        held = warm.num_workers if warm is not None and self.reason != "node lost" else 0
        scaling, record = self.next_attempt(held)
        if warm is not None and warm.num_workers != scaling.num_workers:
            warm.release_placement()
        return scaling, record

    def _wait_for_more(self) -> float:
        """How long the next attempt waits for more than min_workers: a first start a little,
        a restart after a lost node not at all (its capacity will not come back soon)."""
        if self.current is None:
            return START_WAIT_S
        return 0.0 if self.reason == "node lost" else RESTART_WAIT_S

    def failed(self, lost: list[tuple[str, bool]]) -> None:
        """The attempt failed; `lost`: (node id, whether the node was lost) of each rank that died."""
        self.lost_nodes |= {node for node, node_lost in lost if node_lost}
        self.reason = "node lost" if any(n for _, n in lost) else "rank lost" if lost else "failure"

    def grow_to(self, idle: Callable[[], int] = lambda: 0) -> int | None:
        """While an attempt trains: the size to grow to, when a check is due and more workers
        can be placed now (`idle()`: slots the running group holds and no rank uses, e.g. what
        an engine placed again for ranks the run went on without); else None."""
        now = self.clock()
        current = self.current or 0
        if not self.sizing.check_due(now, current):
            return None
        held = idle()
        extra = held + self.probe(self.lost_nodes, max(0, self.sizing.max_workers - current - held))
        target = self.sizing.grow_to(now, current, current + extra)
        if target is not None:
            self.reason = "capacity returned"
        return target

