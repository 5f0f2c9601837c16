"""The report pipeline: from the ranks' reports to a recorded row, a committed checkpoint and
the reply, one round at a time, in round order.

For each round every rank reported (`report_rounds`):
1. the row is made (`Run.row`) and recorded, naming the checkpoint the round has or will
   have. The checkpoint commits now when every saving rank staged its files in its report,
   or later through the commit ledger (`commit_ledger`): when ranks write in the background
   (`async_save`), or when the verdict ends the run at a round without a checkpoint while
   every rank can still save it (`Report.at_end`: a class trainable's
   `CheckpointConfig.checkpoint_at_end`); then the reply says `attach` and each rank's files
   arrive as a `Staged`;
2. `RunConfig.stop` gives its verdict on the row, once: after the commit (a stopper may need
   the round's checkpoint, as population-based training's pause does), or, at a round the
   ranks could still save at the end, before the row is recorded;
3. the reply: stop, the checkpoint `checkpoint="auto"` asks for (`checkpoint_cadence`), the
   checkpoint the round committed. The controller adds what its state asks (a preemption).

This module is the only caller of `Run.record` and `Run.commit_checkpoint`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from unbroken.core.config import RunConfig, stop_due_at, stop_met
from unbroken.execution.checkpoint_cadence import Cadence
from unbroken.execution.commit_ledger import PendingCommit, PendingCommits
from unbroken.execution.engine.base import WorkerGroup, send_each
from unbroken.execution.report_rounds import ReportRounds
from unbroken.run.handle import Run
from unbroken.store.commit import Marker, round_name
from unbroken.worker.protocol import Committed, Reply, Report, Staged

log = logging.getLogger("unbroken")


@dataclass(slots=True)
class Round:
    """A round recorded: its row, whether it has (or will have) a checkpoint, whether the loop
    saves when asked (`auto`), and the verdict of `RunConfig.stop` on it (`attach`: the ranks
    save its checkpoint after the fact)."""

    iteration: int
    row: dict[str, Any]
    saved: bool
    auto: bool
    stop: bool
    attach: bool


class ReportPipeline:
    """One fit()'s reports: `take` each `Report` and `Staged`; the controller replies to each
    round `take` returns, with `reply` unless its state says otherwise."""

    def __init__(self, run: Run, run_config: RunConfig) -> None:
        self.run = run
        self.stop = run_config.stop
        self.verbose = run_config.verbose
        self.cadence = Cadence(run_config.checkpoint_config.mean_time_between_failures_s)
        self.saves = PendingCommits(run.reported)  # the attempt's rounds whose checkpoint is not committed

    def start_attempt(self) -> None:
        self.saves = PendingCommits(self.run.reported)

    def take(self, group: WorkerGroup, rounds: ReportRounds, rank: int, message: Report | Staged,
             world_size: int | None = None) -> Round | None:
        """One rank's `Report` or `Staged`. Returns the round once every rank reported it and
        it is recorded; `world_size`: an elastic run's, added to its rows."""
        if isinstance(message, Staged):
            ready = self.saves.staged(rank, message)
            if ready is not None:
                self._commit_later(group, rounds, ready)
            return None
        by_rank = rounds.add_report(rank, message)
        if by_rank is None:
            return None
        return self._record(group, rounds, message.iteration, by_rank, world_size)

    def _record(self, group: WorkerGroup, rounds: ReportRounds, iteration: int, by_rank: dict[int, Report],
                world_size: int | None) -> Round:
        staged = {r: m.files for r, m in by_rank.items() if m.files is not None}  # written already
        pending = {r for r, m in by_rank.items() if m.pending}  # still writing in the background
        metrics = by_rank[0].metrics
        if world_size is not None:  # an elastic run's rows say how many workers made them
            metrics = {**metrics, "world_size": world_size}
        row = self.run.row(iteration, metrics, {r: m.forward_s for r, m in by_rank.items()})
        # The verdict comes after the commit (a stopper may name the round's checkpoint: PBT's
        # pause), but first where the ranks could still save one at the end.
        early = not staged and not pending and all(m.at_end for m in by_rank.values())
        stop = stop_met(self.stop, row) if early else None
        attach = bool(stop)
        if attach:
            pending = set(by_rank)
        saved = bool(staged or pending)
        name = round_name(iteration, {r: by_rank[r].name for r in staged.keys() | pending})  # of those saving
        save_s = max(m.save_s for m in by_rank.values()) if saved and not attach else None
        self.run.record(row, name if saved else None, save_s)
        validation = next((by_rank[r].validation for r in sorted(by_rank) if by_rank[r].validation), None)
        commit = PendingCommit(iteration, name, row, [by_rank[r].metrics for r in sorted(by_rank)], staged,
                               pending, validation=validation if saved else None)
        if commit.files and not commit.waiting:
            commit.marker = self.run.commit_checkpoint(commit.iteration, commit.per_rank_files(),
                                                       commit.row, commit.name, commit.validation)
        ready = self.saves.round(commit)
        if ready is not None:
            self._commit_later(group, rounds, ready)
        if stop is None:
            stop = stop_met(self.stop, row)
        if self.verbose >= 2:
            log.info("run %s: %s", self.run.manifest.name, {k: v for k, v in row.items() if k != "timestamp"})
        return Round(iteration, row, saved, by_rank[0].auto, stop, attach)

    def reply(self, done: Round) -> Reply:
        """The reply to a recorded round: stop when its row met `RunConfig.stop` (and
        `attach`), checkpoint at the next report when `checkpoint="auto"`'s cadence says."""
        due = done.auto and self.cadence.due(done.row, done.saved, self.run.manifest.attempts, time.time())
        return Reply(stop=done.stop, checkpoint=due, committed=self.committed(done.iteration),
                     verdict_at=stop_due_at(self.stop), attach=done.attach)

    def committed(self, iteration: int) -> str | None:
        """The name of the checkpoint round `iteration` committed, if it did (so far)."""
        latest = self.run.checkpoints.latest
        return latest.name if latest is not None and latest.iteration == iteration else None

    def _commit_later(self, group: WorkerGroup, rounds: ReportRounds, save: PendingCommit) -> None:
        """Commit a round's checkpoint whose files every rank made durable after its report, and
        tell the ranks still running (`train.get_all_reported_checkpoints` waits for it)."""
        marker = self.run.commit_checkpoint(save.iteration, save.per_rank_files(), save.row, save.name,
                                            save.validation)
        self.saves.committed(save, marker)
        send_each(group, rounds.running, Committed(save.iteration, marker.name))

    def commit_late(self, iteration: int, per_rank_files: list[Any], row: dict[str, Any]) -> Marker:
        """Commit the checkpoint a rank saved just in time for round `iteration`, recorded
        earlier as `row` (see `recovery.just_in_time`); the round's name is the default one."""
        return self.run.commit_checkpoint(iteration, per_rank_files, row)

    def can_complete(self, gone: set[int]) -> bool:
        """True while a checkpoint can still commit: no rank it waits for is `gone`."""
        return self.saves.can_complete(gone)

    def close(self) -> None:
        """The attempt ended: checkpoints still pending never commit in it."""
        self.saves.close()
