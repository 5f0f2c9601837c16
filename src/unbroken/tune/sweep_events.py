"""What the sweep driver does with its trials' results as they come, and with the sweep's own
end: the sweep callbacks (`tune.callback`), the stopper's `stop_all` and the time budget
(`sweep_stop`), fed by one reading of the trials' new rows (`trial_rows`).

The sweep driver calls `tick` in its loop, `started` and `ended` for each trial, and
`finished` at the end of its fit(); `tick` returns why the sweep ends now, if it does. The
rows are read only when something needs them (a callback's `on_trial_result`, a stopper
whose `stop_all` depends on the rows); the time budget and a stop that needs no rows cost
nothing per tick.
"""

from __future__ import annotations

from typing import Any

from unbroken.store import sweep_manifest as sw
from unbroken.store.storage import Storage
from unbroken.store.sweep_manifest import SweepManifest, TrialRecord
from unbroken.tune.callback import Callback, SweepCallbacks, Trial
from unbroken.tune.sweep_stop import SweepWatch
from unbroken.tune.trial_rows import RowFeed


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
        self.watch = SweepWatch(stop, time_budget_s, manifest.running_s)
        self.feed = RowFeed(storage) if self.watch.feeds or self.callbacks.wants_results else None
        self._last: dict[str, dict[str, Any]] = {}  # each trial's last result
        self.unsaved = False  # results were delivered since the driver last saved the manifest
        self.callbacks.call("setup", stop=stop, num_samples=manifest.num_samples,
                            total_num_samples=manifest.total_trials)

    def trials(self) -> list[Trial]:
        return [self.view(r) for r in self.manifest.trials]

    def view(self, record: TrialRecord) -> Trial:
        return Trial(trial_id=trial_id(self.manifest, record), trial_name=record.title or record.name,
                     config=record.config if isinstance(record.config, dict) else {}, status=record.status,
                     path=self.storage.url(record.name), last_result=self._last.get(record.name, {}),
                     error=record.error)

    def tick(self, now: bool = False) -> str | None:
        """Deliver the trials' new results, feed the stopper, and say why the sweep ends now."""
        rows: list[tuple[str, str, dict]] = []
        if self.feed is not None:
            m = self.manifest
            started = {r.name: trial_id(m, r) for r in m.trials if r.started_at}
            rows = self.feed.poll(started, {r.name for r in m.trials if r.status in sw.DONE}, now=now)
            self._deliver(rows)
        return self.watch.check(rows)

    def _deliver(self, rows: list[tuple[str, str, dict]]) -> None:
        for name, _, row in rows:
            self._last[name] = row
            record = self.manifest.trial(name)
            if record is None or row["training_iteration"] <= record.results_seen:
                continue  # delivered by an earlier driver of the sweep
            record.results_seen = row["training_iteration"]
            self.unsaved = True
            if self.callbacks.wants_results:
                self.callbacks.trial_hook("on_trial_result", self.trials(), self.view(record),
                                          result=dict(row))

    def started(self, record: TrialRecord) -> None:
        if self.callbacks:
            self.callbacks.trial_hook("on_trial_start", self.trials(), self.view(record))

    def ended(self, record: TrialRecord) -> None:
        """A trial is recorded TERMINATED or ERROR: its last results, then its end."""
        if self.feed is not None:
            rows = self.feed.poll({record.name: trial_id(self.manifest, record)}, {record.name}, now=True)
            self._deliver(rows)
            self.watch.check(rows)  # fed; what it decides, the next tick says
        if not self.callbacks:
            return
        hook = "on_trial_error" if record.status == sw.ERROR else "on_trial_complete"
        self.callbacks.trial_hook(hook, self.trials(), self.view(record))

    def finished(self) -> None:
        if self.feed is not None:
            self.tick(now=True)
        self.callbacks.call("on_experiment_end", self.trials())
