"""A local worker group kept from one run to the next in the same driver process.

With `TuneConfig(reuse_actors=True)` a trial's process runs one trial after another (see
`tune.trial`), and each run's ranks go on in the processes of the run before instead of new
ones, with what they imported and set up (`worker.process_reuse`). The trial's process asks
for it (`keep_groups`) before its first run; its local worker groups then start ranks that
wait for another run after one ends cleanly.

- A group is kept only when its attempt ended cleanly: `LocalWorkerGroup.shutdown` without
  `kill` parks it here (`park`) while every rank lives. A failed attempt's group is killed as
  before, and the next attempt starts new processes.
- The next run takes the parked group (`take`) when it has the same number of ranks and
  CPUs each, and every parked rank still lives; `LocalWorkerGroup.start` then sends each
  rank its payload instead of starting a process. Otherwise the parked group ends and new
  processes start, so a rank that died while parked costs nothing but its start.
- `release` ends a parked group: its ranks see their link closed, release what runs left
  in them, and exit. A parked rank dies with the driver process too (PDEATHSIG), as any.
"""

from __future__ import annotations

from typing import Any

_keeping = False
_parked: Any = None  # the LocalWorkerGroup kept for the next run


def keep_groups(enabled: bool) -> None:
    """Keep this process's local worker groups from one run to the next (see the docstring)."""
    global _keeping
    _keeping = enabled


def keeping() -> bool:
    """Whether local worker groups started now are kept between runs."""
    return _keeping


def park(group: Any) -> bool:
    """Keep `group`, whose attempt ended cleanly, for the next run; False (nothing kept) when
    groups are not kept here or one of its ranks has ended."""
    global _parked
    if not _keeping or not group.all_alive():
        return False
    release()
    _parked = group
    return True


def take(num_workers: int, cpus: int) -> Any:
    """The parked group, when it fits a run of `num_workers` ranks of `cpus` CPUs and every
    rank of it lives; otherwise None, and the parked group (if any) ends."""
    global _parked
    group, _parked = _parked, None
    if group is None:
        return None
    if (group.num_workers, group.cpus) == (num_workers, cpus) and group.all_alive():
        return group
    group.close()
    return None


def release() -> None:
    """End the parked group, if there is one."""
    global _parked
    group, _parked = _parked, None
    if group is not None:
        group.close()
