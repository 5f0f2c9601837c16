"""How the Ray engine (unbroken.execution.engine.ray) learns that a rank ended without `Done`,
and why.

A rank is lost when its process dies (its running call fails with `ActorDiedError` within
milliseconds) or its node does: the call then fails with `ActorUnavailableError` about a
second after the loss, and that counts as lost at once (Ray's dead-node verdict comes ~15 s
later, and the peers cannot progress). A rank whose connection to the driver closes is
looked into at once; one whose node vanished without closing it shows in the periodic look
at the ranks' calls. Each death is reported once, and never before its rank's last message.
"""

from __future__ import annotations

from typing import Any

import ray
import ray.exceptions

from unbroken.errors import WorkerDied
from unbroken.execution.engine.base import Event
from unbroken.execution.engine.ray_actor import await_verdict, why_died

# After a rank's connection closed without `Done`: how long Ray may take to say why (a killed
# process: milliseconds; a lost node: ~1.4 s, measured). Past it, the rank is lost all the same.
WHY_WAIT_S = 2.0


def death(rank: int, ref: Any, meta: dict[str, Any]) -> WorkerDied | None:
    """Why `rank`'s ended call `ref` ended (None: it ended cleanly, its `Done` is on the way)."""
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayActorError as error:
        return why_died(rank, error, meta)
    except Exception as error:  # noqa: BLE001 - the call itself failed: a death all the same
        return WorkerDied(rank, cause=f"{type(error).__name__}: {error}", engine="ray")
    return None  # it returned: its outcome (Done or Failed) was sent before


def lost_with_node(rank: int, ref: Any, meta: dict[str, Any]) -> bool:
    """Whether rank `rank` (its call `ref`, its actor's `meta`) was lost with its node; if so,
    once Ray has declared the node dead (`await_verdict`), so that its bundle is placed on
    another node."""
    ended, _ = ray.wait([ref], timeout=0)
    died = death(rank, ref, meta) if ended else None
    if died is None or not died.node_lost:
        return False
    await_verdict(meta["node_id"])
    return True


class RankDeaths:
    """The ranks of one attempt that finished or were reported dead, and the deaths held back
    until their rank's messages have been handled."""

    def __init__(self) -> None:
        self.finished: set[int] = set()
        self.ended: set[int] = set()        # reported as died, or finished
        self.dying: dict[int, WorkerDied] = {}  # shows in the next poll

    def due(self) -> list[Event]:
        """The deaths held back for this poll, reported from now on."""
        out: list[Event] = [(rank, died) for rank, died in self.dying.items()]
        self.ended.update(self.dying)
        self.dying = {}
        return out

    def look(self, refs: list[Any], metas: list[dict[str, Any]], closed: list[int], out: list[Event]) -> None:
        """Turn ended calls (`refs`, by rank) and closed connections of unfinished ranks into
        deaths; a rank with a message in `out` dies in the next poll, after its message was
        handled."""
        live = {rank: ref for rank, ref in enumerate(refs)
                if rank not in self.ended and rank not in self.finished}
        if not live:
            return
        ended, _ = ray.wait(list(live.values()), num_returns=len(live), timeout=0)
        gone = {rank for rank, ref in live.items() if ref in ended}
        for rank in closed:
            if rank in live and rank not in gone:
                ready, _ = ray.wait([live[rank]], timeout=WHY_WAIT_S)
                if ready:
                    gone.add(rank)
                else:
                    where = metas[rank]["address"]
                    self.dying[rank] = WorkerDied(
                        rank, cause=f"its connection to the driver closed (node {where})", engine="ray")
        spoke = {rank for rank, _ in out}
        for rank in sorted(gone):
            died = death(rank, refs[rank], metas[rank])
            if died is None:
                continue
            if rank in spoke or rank in self.dying:
                self.dying[rank] = died
            else:
                out.append((rank, died))
                self.ended.add(rank)
        for rank in list(self.dying):
            if rank not in spoke:
                out.append((rank, self.dying.pop(rank)))
                self.ended.add(rank)

    def lost(self, refs: list[Any], metas: list[dict[str, Any]], wait_s: float) -> list[WorkerDied]:
        """The ranks killed or lost so far (`WorkerGroup.lost_ranks`), waiting up to `wait_s`
        for one to show."""
        live = [ref for rank, ref in enumerate(refs) if rank not in self.finished]
        if not live:
            return []
        ray.wait(live, num_returns=1, timeout=wait_s)
        ended, _ = ray.wait(live, num_returns=len(live), timeout=0)
        lost = []
        for rank, ref in enumerate(refs):
            if ref in ended and rank not in self.finished:
                died = death(rank, ref, metas[rank])
                if died is not None and died.violent:
                    lost.append(died)
        return lost
