"""Just-in-time checkpoints, the driver's half (steps 4 and 5 of the protocol in
`unbroken.worker.recovery.just_in_time`, whose docstring has it whole): once a failure is final, choose the
saver among the ranks' offers, wait within bounds for its save, and hand the controller what
it staged to commit. Recovery calls it through `in_place.settle` (`Recovery.save_just_in_time`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from unbroken.errors import StorageError, WorkerDied
from unbroken.run.handle import Run
from unbroken.store.commit import checkpoint_name
from unbroken.worker.recovery.messages import JitArmed, JitOffer, JitSave, JitSaved

log = logging.getLogger("unbroken")

# How long the driver waits for the ranks still running to offer once the failure is final.
OFFER_WAIT_S = 2.0
# How long the driver waits for the chosen rank's save (less if that rank dies).
SAVE_WAIT_S = 60.0


class Coordinator:
    """The driver's side for one attempt: which ranks are armed, their offers, the saver."""

    def __init__(self) -> None:
        self.armed: set[int] = set()
        self.seeds: dict[int, int] = {}  # each armed rank's step seed
        self.offers: dict[int, JitOffer] = {}
        self.answered: set[int] = set()
        self.dead: set[int] = set()
        self.saver: int | None = None
        self.saved: JitSaved | None = None
        self.reasons: list[str] = []  # why ranks could not save, for the attempt record
        self.closed = False

    def take(self, group: Any, rank: int, message: Any) -> None:
        """A JIT message from `rank` (JitArmed, JitOffer, JitSaved)."""
        if isinstance(message, JitArmed):
            self.armed.add(rank)
            self.seeds[rank] = message.step_seed
        elif isinstance(message, JitOffer):
            self.offers[rank] = message
            if message.iteration is None:
                self.reasons.append(f"rank {rank}: {message.reason}")
            if self.closed or message.iteration is None:
                self._answer(group, rank, None)
        elif isinstance(message, JitSaved) and rank == self.saver:
            self.saved = message

    def _answer(self, group: Any, rank: int, iteration: int | None) -> None:
        if rank not in self.answered:
            self.answered.add(rank)
            group.send(rank, JitSave(iteration, dict(self.seeds) if iteration is not None else None))

    def choose(self, group: Any, target: int | None, running: set[int]) -> None:
        """Pick the saver among the offers of checkpoint `target`, or release the offering
        ranks: the lowest valid offer wins once no lower armed rank is still `running`."""
        for rank in sorted(self.offers):
            offer = self.offers[rank]
            if rank in self.answered or offer.iteration is None:
                continue
            if self.saver is not None or offer.iteration != target:
                if target is not None and offer.iteration != target:
                    self.reasons.append(f"rank {rank}: its round {offer.iteration} is not complete")
                self._answer(group, rank, None)
            elif any(r < rank for r in running & self.armed):
                self._answer(group, rank, None)  # exiting releases the lower ranks blocked with it
            else:
                self.saver = rank
                self._answer(group, rank, target)

    def waiting_for(self, running: set[int]) -> str | None:
        """What the driver still waits for ("offers", "save"), or None when it is settled."""
        if self.saver is not None:
            return None if self.saved is not None or self.saver in self.dead else "save"
        return "offers" if running & self.armed else None

    def target(self, row: dict[str, Any] | None, attempt: int, latest_iteration: int | None,
               latest_name: str | None) -> int | None:
        """The iteration a just-in-time checkpoint may save, given the run's last row and its
        latest checkpoint: the last round attempt `attempt` completed, when it is newer than
        the latest checkpoint and has none of its own; None otherwise, with the reason noted."""
        if row is None or row.get("attempt") != attempt:
            self.reasons.append("no report round was completed in this attempt")
            return None
        iteration = row["training_iteration"]
        if row.get("checkpoint_dir_name"):
            self.reasons.append(f"round {iteration} has a checkpoint of its own")
        elif latest_iteration is not None and latest_iteration >= iteration:
            self.reasons.append(f"checkpoint {latest_name} is as new as round {iteration}")
        else:
            return iteration
        return None

    def close(self, group: Any) -> None:
        """Settled: every rank still waiting for a word is told not to save."""
        self.closed = True
        for rank in self.offers:
            self._answer(group, rank, None)


def settle(coordinator: Coordinator, group: Any, target: int | None, running: Callable[[], set[int]],
           events: Callable[[float], Iterator[tuple[int, Any]]]) -> JitSaved | None:
    """Run steps 4 and 5 from the driver: choose a saver for checkpoint `target`, wait (within
    the bounds) for its save, and return what it staged (None: no checkpoint, see `reasons`).
    `running()`: the ranks that may still offer; `events(timeout)`: the group's next events,
    each already taken by the controller."""
    start = time.monotonic()
    while True:
        coordinator.choose(group, target, running())
        waiting = coordinator.waiting_for(running())
        if waiting is None:
            break
        limit = start + (OFFER_WAIT_S if waiting == "offers" else SAVE_WAIT_S)
        left = limit - time.monotonic()
        if left <= 0:
            coordinator.reasons.append(
                f"no rank offered within {OFFER_WAIT_S:g} s (ranks {sorted(running() & coordinator.armed)} "
                "still running, perhaps blocked in a collective)" if waiting == "offers" else
                f"rank {coordinator.saver} did not finish saving within {SAVE_WAIT_S:g} s")
            break
        for rank, message in events(min(left, 0.5)):
            if isinstance(message, WorkerDied):
                coordinator.dead.add(rank)
                if rank == coordinator.saver and coordinator.saved is None:
                    coordinator.reasons.append(f"rank {rank} died while saving")
    coordinator.close(group)
    saved = coordinator.saved
    if saved is not None and saved.files is None:
        coordinator.reasons.append(f"rank {coordinator.saver} could not save: {saved.error}")
        return None
    return saved


def commit_just_in_time(run: Run, coordinator: Coordinator, group: Any, running: Callable[[], set[int]],
                        events: Callable[[float], Iterator[tuple[int, Any]]],
                        commit: Callable[[int, list[Any], dict[str, Any]], Any]) -> dict[str, Any]:
    """The failure of the current attempt of `run` is final: have a surviving rank save the
    last complete round (`settle`), `commit(iteration, per-rank files, row)` it as that
    round's checkpoint (the report pipeline's `commit_late`), and return what happened for
    the attempt record (`Attempt.jit_checkpoint`)."""
    started = time.monotonic()
    row, latest = run.history.last, run.checkpoints.latest
    target = coordinator.target(row, run.attempt.number, latest.iteration if latest else None,
                                latest.name if latest else None)
    saved = settle(coordinator, group, target, running, events)
    record: dict[str, Any] = {"iteration": None}
    if saved is not None and target is not None:
        try:
            row = {**row, "checkpoint_dir_name": checkpoint_name(saved.iteration)}
            commit(saved.iteration, [saved.files], row)
            record = {"iteration": saved.iteration, "rank": coordinator.saver,
                      "seconds": round(time.monotonic() - started, 3)}
            log.warning("run %s: rank %d saved iteration %d just in time; the next attempt resumes "
                        "there", run.path, coordinator.saver, saved.iteration)
        except StorageError as e:
            coordinator.reasons.append(f"the commit failed: {e}")
    if record["iteration"] is None:
        record["why_not"] = "; ".join(coordinator.reasons) or "every rank died before it could offer"
        log.warning("run %s: no just-in-time checkpoint (%s); the next attempt resumes from the "
                    "latest periodic one", run.path, record["why_not"])
    return record
