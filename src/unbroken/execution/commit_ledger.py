"""The driver's commit ledger: recorded rounds whose checkpoint is not committed yet.

A round's row is recorded when the round completes; its checkpoint commits then (every rank
staged its files in the report), or later, once each rank that writes in the background
says `Staged` (step 4 of the protocol in `unbroken.worker.async_save`), or once the ranks
have saved a stopped run's last round after the fact (`CheckpointConfig.checkpoint_at_end`).
The ledger also keeps the rounds' `reported` calls in round order behind a save that is not
settled, so callbacks see each round once, with its committed checkpoint, in order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from unbroken.store.commit import FileEntry, Marker
from unbroken.worker.protocol import Staged


@dataclass
class PendingCommit:
    """A recorded round whose checkpoint waits for ranks' background writes (step 4)."""

    iteration: int
    name: str | None                # the checkpoint directory name the ranks gave, if any
    row: dict[str, Any]             # the round's metric row, as recorded
    metrics: list[dict[str, Any]]   # what each rank reported, in rank order
    files: dict[int, list[FileEntry]] = field(default_factory=dict)  # by rank, as they arrive
    waiting: set[int] = field(default_factory=set)                   # ranks whose Staged is due
    marker: Marker | None = None    # once committed
    settled: bool = False           # committed, or never will be in this attempt
    validation: dict[str, Any] | None = None  # the validation the round's report asks for

    def per_rank_files(self) -> list[list[FileEntry]]:
        return [self.files[r] for r in sorted(self.files)]


class PendingCommits:
    """The driver's asynchronous saves that are recorded but not yet committed (one attempt),
    and the rounds' `reported` calls, kept in round order behind a save that is not settled
    (callbacks see each round once, with its committed checkpoint, in order)."""

    def __init__(self, reported: Callable[[list[dict[str, Any]], Marker | None], None]) -> None:
        self.pending: dict[int, PendingCommit] = {}
        self._early: dict[int, dict[int, list[FileEntry]]] = {}  # Staged before its round completed
        self._reported = reported
        self._rounds: deque[PendingCommit] = deque()

    def round(self, commit: PendingCommit) -> PendingCommit | None:
        """Round `commit.iteration` is recorded: settled already (no save pending; its
        `marker` if it committed one), or waiting for `commit.waiting`. Returns it when the
        files it waits for are all durable already (a rank's `Staged` may arrive before
        another rank's report completes the round)."""
        asynchronous = bool(commit.waiting)
        for rank, files in self._early.pop(commit.iteration, {}).items():
            commit.files[rank] = files
            commit.waiting.discard(rank)
        self._rounds.append(commit)
        if not asynchronous:
            commit.settled = True
            self._flush()
        elif commit.waiting:
            self.pending[commit.iteration] = commit
        else:
            return commit
        return None

    def staged(self, rank: int, message: Staged) -> PendingCommit | None:
        """Take one rank's `Staged`; returns the save once every rank's files are durable."""
        commit = self.pending.get(message.iteration)
        if commit is None:
            self._early.setdefault(message.iteration, {})[rank] = message.files
            return None
        commit.files[rank] = message.files
        commit.waiting.discard(rank)
        return None if commit.waiting else self.pending.pop(message.iteration)

    def committed(self, commit: PendingCommit, marker: Marker) -> None:
        commit.marker, commit.settled = marker, True
        self._flush()

    def can_complete(self, gone: set[int]) -> bool:
        """True while a pending save can still commit: no rank it waits for is gone."""
        return any(not commit.waiting & gone for commit in self.pending.values())

    def close(self) -> None:
        """The attempt ended: saves still pending never commit; report every round left."""
        self.pending.clear()
        for commit in self._rounds:
            commit.settled = True
        self._flush()

    def _flush(self) -> None:
        while self._rounds and self._rounds[0].settled:
            commit = self._rounds.popleft()
            self._reported(commit.metrics, commit.marker)
