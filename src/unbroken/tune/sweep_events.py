"""What the sweep driver does with its trials' progress as it comes, and with the sweep's own
end: the sweep callbacks (`tune.callback`, their states in `callback_state`), the stopper's
`stop_all` and the time budget (`sweep_stop`), fed by one reading of the trials' new rows
(`trial_rows`) and of their runs' other events (`trial_events`).

The sweep driver calls `step_begin`/`step_end` around each pass of its loop, `tick` in it,
`started` and `ended` for each trial, and `finished` at the end of its fit(); `tick` returns
why the sweep ends now, if it does. Each delivery moves the trial's mark in the manifest and
sets `unsaved`; every save of the manifest takes the callbacks' states first (`states`).
What is read is read only when something needs it (a hook some callback overrides, a stopper
whose `stop_all` depends on the rows); the time budget and a stop that needs no rows cost
nothing per tick.
"""

from __future__ import annotations

import time
from typing import Any

from unbroken.store import sweep_manifest as sw
from unbroken.store.checkpoint import Checkpoint
from unbroken.store.storage import Storage
from unbroken.store.sweep_manifest import SweepManifest, TrialRecord
from unbroken.tune.callback import Callback, SweepCallbacks, Trial
from unbroken.tune.callback_state import CallbackStates
from unbroken.tune.sweep_stop import SweepWatch
from unbroken.tune.trial_events import ATTEMPT_HOOKS, SAVE_HOOKS, AttemptEvent, Save, TrialRuns
from unbroken.tune.trial_rows import READ_EVERY_S, RowFeed


def trial_id(manifest: SweepManifest, record: TrialRecord) -> str:
    """Ray's trial id of a trial: the sweep's id and the trial's index."""
    return f"{manifest.sweep_id[:8]}_{record.index:05d}"


class SweepEvents:
    """The callbacks and the sweep's end, for one fit() of the sweep."""

    def __init__(self, storage: Storage, manifest: SweepManifest, callbacks: list[Callback], stop: Any,
                 time_budget_s: float | None) -> None:
        self.storage = storage
        self.manifest = manifest
        self.callbacks = SweepCallbacks(callbacks)
        self.states = CallbackStates(storage, manifest, callbacks)
        self.states.restore()  # before anything is delivered
        self.watch = SweepWatch(stop, time_budget_s, manifest.running_s)
        self.feed = RowFeed(storage) if self.watch.feeds or self.callbacks.wants_results else None
        saves, attempts = self.callbacks.wants(*SAVE_HOOKS), self.callbacks.wants(*ATTEMPT_HOOKS)
        self.runs = TrialRuns(storage, saves, attempts) if saves or attempts else None
        self._last: dict[str, dict[str, Any]] = {}  # each trial's last result
        self._due: dict[str, list[AttemptEvent]] = {}  # restores and recoveries read, not told yet
        self._read_at = -READ_EVERY_S
        self.unsaved = False  # marks moved since the driver last saved the manifest
        self.callbacks.call("setup", stop=stop, num_samples=manifest.num_samples,
                            total_num_samples=manifest.total_trials)

    def trials(self) -> list[Trial]:
        return [self.view(r) for r in self.manifest.trials]

    def view(self, record: TrialRecord) -> Trial:
        return Trial(trial_id=trial_id(self.manifest, record), trial_name=record.title or record.name,
                     config=record.config if isinstance(record.config, dict) else {}, status=record.status,
                     path=self.storage.url(record.name), last_result=self._last.get(record.name, {}),
                     error=record.error, trainable_name=str(self.manifest.trainable.get("name", "")))

    def step_begin(self) -> None:
        """A pass of the sweep driver's loop begins."""
        if self.callbacks.wants("on_step_begin"):
            self.callbacks.call("on_step_begin", iteration=self.callbacks.iteration, trials=self.trials())

    def step_end(self) -> None:
        """A pass of the sweep driver's loop ended."""
        self.callbacks.iteration += 1
        if self.callbacks.wants("on_step_end"):
            self.callbacks.call("on_step_end", iteration=self.callbacks.iteration, trials=self.trials())

    def tick(self, now: bool = False) -> str | None:
        """Deliver what the trials did since the last tick, feed the stopper, and say why the
        sweep ends now."""
        rows: list[tuple[str, str, dict]] = []
        read: list[TrialRecord] = []
        if now or time.monotonic() - self._read_at >= READ_EVERY_S:  # rows and runs read together
            self._read_at = time.monotonic()
            m = self.manifest
            if self.feed is not None:
                started = {r.name: trial_id(m, r) for r in m.trials if r.started_at}
                rows = self.feed.poll(started, {r.name for r in m.trials if r.status in sw.DONE}, now=True)
            read = self.runs.to_read(m.trials) if self.runs is not None else []
        self._read_attempts(read)  # after the rows: every attempt that has rows is in run.json
        self._deliver(rows)
        self._runs_events(read)
        for record in self.manifest.trials:
            if record.end_due and record.status in sw.DONE:
                self._end(record)  # it ended while no driver of the sweep could tell
        return self.watch.check(rows)

    def _read_attempts(self, records: list[TrialRecord]) -> None:
        for record in records if self.runs is not None else []:
            self._due[record.name] = self.runs.attempt_events(record)

    def _deliver(self, rows: list[tuple[str, str, dict]]) -> None:
        for name, _, row in rows:
            record = self.manifest.trial(name)
            if record is not None:
                self._attempt_hooks(record, row.get("attempt"))
            self._last[name] = row
            if record is None:
                continue
            if row["training_iteration"] <= record.results_seen:
                continue  # delivered by an earlier driver of the sweep
            record.results_seen = row["training_iteration"]
            self.unsaved = True
            if self.callbacks.wants_results:
                self.callbacks.trial_hook("on_trial_result", self.trials(), self.view(record),
                                          result=dict(row))

    def _attempt_hooks(self, record: TrialRecord, before: Any) -> None:
        """Tell the trial's restores and recoveries due before the results of attempt `before`
        (all of them when None)."""
        due = self._due.get(record.name) or []
        while due and (before is None or (isinstance(before, int) and due[0].before <= before)):
            event = due.pop(0)
            self.callbacks.trial_hook(event.hook, self.trials(), self.view(record))
            if event.hook == "on_trial_restore":
                record.restores_seen = event.attempt
            else:
                record.recovers_seen = event.attempt
            self.unsaved = True

    def _runs_events(self, records: list[TrialRecord]) -> None:
        """The rest of what was read of the trials' runs: restores and recoveries that no row
        came after yet, then the checkpoints committed (after their rows' results)."""
        for record in records if self.runs is not None else []:
            self._attempt_hooks(record, None)
            for save in self.runs.new_saves(record, record.results_seen if self.feed is not None else None):
                self._save_hooks(record, save)

    def _save_hooks(self, record: TrialRecord, save: Save) -> None:
        run = self.storage.child(record.name)
        checkpoint = Checkpoint(run.url(save.name), run.filesystem_arg)
        trials, view = self.trials(), self.view(record)
        self.callbacks.trial_hook("on_checkpoint", trials, view, checkpoint=checkpoint)
        self.callbacks.trial_hook("on_trial_save", trials, view)
        record.saves_seen = [save.attempt, save.iteration]
        self.unsaved = True

    def started(self, record: TrialRecord) -> None:
        if self.runs is not None:
            self.runs.again(record.name)
        if self.callbacks:
            self.callbacks.trial_hook("on_trial_start", self.trials(), self.view(record))

    def ended(self, record: TrialRecord) -> None:
        """A trial is recorded TERMINATED or ERROR: the rest of what it did, then its end."""
        rows: list[tuple[str, str, dict]] = []
        if self.feed is not None:
            rows = self.feed.poll({record.name: trial_id(self.manifest, record)}, {record.name}, now=True)
        read = [record]  # its run, once more (the next tick does not read it again)
        if self.runs is not None:
            self.runs.read(record.name)
        self._read_attempts(read)
        self._deliver(rows)
        self._runs_events(read)
        self.watch.check(rows)  # fed; what it decides, the next tick says
        self._end(record)

    def _end(self, record: TrialRecord) -> None:
        """Tell the trial's end (once: `end_due` is set in the same save as its status)."""
        if record.end_due:
            record.end_due, self.unsaved = False, True
        if self.callbacks:
            hook = "on_trial_error" if record.status == sw.ERROR else "on_trial_complete"
            self.callbacks.trial_hook(hook, self.trials(), self.view(record))

    def finished(self) -> None:
        if self.feed is not None or self.runs is not None:
            self.tick(now=True)
        self.callbacks.call("on_experiment_end", trials=self.trials())
