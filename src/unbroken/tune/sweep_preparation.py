"""Preparing a sweep's fit() before any of its trials runs.

`PreparedSweep` is the sweep as the driver that holds its lease keeps it: the manifest, which
that driver alone writes, the trial records in it, and what each trial's config and stop
condition are made from. Its `prepare` brings the manifest in step with the trial
directories (a killed driver left it behind them: `reconciled`), with the scheduler's paused
trials and with the searcher (proposals it made that were never recorded, outcomes it was
never told), and queues the trials this fit() runs, as Tuner.restore's `ResumeFlags` say.
The sweep driver (`sweep_driver.SweepDriver`, a `PreparedSweep`) then runs them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from unbroken.errors import UnbrokenError
from unbroken.store import history
from unbroken.store import sweep_manifest as sw
from unbroken.store.storage import Storage
from unbroken.store.sweep_manifest import TrialRecord
from unbroken.tune import pbt
from unbroken.tune import search_space as ss
from unbroken.tune.callback import split
from unbroken.tune.hyperband import Bands, HyperBandScheduler
from unbroken.tune.pbt import PopulationBasedTraining
from unbroken.tune.population import Population
from unbroken.tune.reconcile import reconciled, rerun
from unbroken.tune.search.searcher import SearchContext, Searcher
from unbroken.tune.sweep_events import SweepEvents, trial_id
from unbroken.tune.sweep_stop import TrialStop, fail_fast, needs_wrapping, unmark_stopped, user_stop
from unbroken.tune.trial_naming import TrialNaming

log = logging.getLogger("unbroken")


@dataclass
class ResumeFlags:
    """What a fit() does with trials that did not finish (Tuner.restore's arguments)."""

    unfinished: bool = True
    errored: bool = False
    restart: bool = False


@dataclass
class PreparedSweep:
    """One sweep, opened by the driver that holds its lease: its records, and `prepare`."""

    storage: Storage
    manifest: sw.SweepManifest
    previous: bytes | None
    trainable: Any
    space: dict[str, Any]
    run_config: Any
    searcher: Searcher
    scheduler: Any
    metric: str | None
    mode: str | None
    total: int
    population: Population | Bands | None = None  # trials that pause: PBT, HyperBand (set by prepare)
    queue: list[str] = field(default_factory=list)
    ctx: SearchContext | None = None
    time_budget_s: float | None = None
    naming: TrialNaming = field(default_factory=TrialNaming)
    events: SweepEvents | None = None  # callbacks, stop_all, the time budget (set by prepare)
    _t0: float = 0.0  # when execute() began (monotonic)
    _spent_before: float = 0.0  # running_s when execute() began

    # -- bookkeeping ----------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.manifest.name

    def save(self) -> None:
        if self._t0:
            self.manifest.running_s = self._spent_before + time.monotonic() - self._t0
        self.previous = sw.save(self.storage, self.manifest, self.previous)

    def _new_record(self, values: dict[str, Any], searcher_id: Any) -> TrialRecord:
        index = len(self.manifest.trials)
        try:
            resolved = ss.resolve(self.space, values)
            config = ss.spec(resolved)
        except UnbrokenError:
            resolved = config = values
        record = TrialRecord(index=index, name=sw.trial_name(index), values=values, config=config,
                             searcher_id=searcher_id)
        record.name, record.title = self.naming.names(index, trial_id(self.manifest, record), resolved,
                                                      {t.name for t in self.manifest.trials})
        self.manifest.trials.append(record)
        return record

    def _last_row(self, record: TrialRecord) -> dict[str, Any] | None:
        rows = history.timeline(history.read_rows(self.storage.child(record.name)))
        return rows[-1] if rows else None

    def _tell(self, record: TrialRecord) -> None:
        assert self.ctx is not None
        self.searcher.on_trial_complete(self.ctx, record, self._last_row(record), record.status == sw.ERROR)
        record.told = True

    def _config_of(self, name: str, with_overrides: bool = True) -> dict[str, Any]:
        """A trial's config: as sampled, and as population-based training changed it since."""
        record = self.manifest.trial(name)
        assert record is not None, name
        config = ss.resolve(self.space, record.values)
        if with_overrides and self.population is not None:
            config = pbt.apply(config, self.population.overrides(name))
        return config

    def _trial_stop(self, record: TrialRecord) -> TrialStop:
        """The user's stop condition as this trial asks it, which also stops it once the sweep
        has ended (see sweep_stop)."""
        stop = user_stop(self.trainable, self.run_config)
        wrapped = needs_wrapping(stop, self.time_budget_s, fail_fast(self.trainable, self.run_config))
        return TrialStop(record.name, trial_id(self.manifest, record), self.storage.url(),
                         self.run_config.storage_filesystem, stop, wrapped)

    # -- preparing a fit() ------------------------------------------------------------------
    def prepare(self, flags: ResumeFlags) -> None:
        """Bring the manifest in step with the trial directories and the searcher, decide which
        trials this fit() runs, and save."""
        m = self.manifest
        m.status = sw.SWEEP_RUNNING
        if isinstance(self.scheduler, PopulationBasedTraining):
            self.population = Population(self.storage, self.scheduler, self.metric or "", self.mode or "max",
                                         m.seed, self._config_of)
        elif isinstance(self.scheduler, HyperBandScheduler):
            self.population = Bands(self.storage, self.scheduler, self.metric or "", self.mode or "max",
                                    lambda: self.manifest.trials)
        if self.population is not None:
            for record in m.trials:
                if record.status not in sw.DONE:
                    self.population.catch_up(record.name, self._trial_stop(record))
        m.trials = [reconciled(self.storage, record, self.scheduler) for record in m.trials]
        self.ctx = SearchContext(storage=self.storage, name=m.name, space=self.space, seed=m.seed,
                                 metric=self.metric, mode=self.mode, num_samples=m.num_samples)
        new: list[str] = []
        for values, searcher_id in self.searcher.open(self.ctx, m.trials):
            if len(m.trials) < self.total:
                new.append(self._new_record(values, searcher_id).name)
                log.warning("sweep %s: adopted %s, which the searcher had proposed when the previous "
                            "driver stopped", m.name, new[-1])
        if self.searcher.upfront:
            while len(m.trials) < self.total:
                values, searcher_id = self.searcher.propose(self.ctx, len(m.trials))
                new.append(self._new_record(values, searcher_id).name)
        for record in m.trials:
            if record.status in sw.DONE and not record.told:
                self._tell(record)
        self.events = SweepEvents(self.storage, m, split(self.run_config.callbacks)[0],
                                  user_stop(self.trainable, self.run_config), self.time_budget_s)
        if m.stopped is not None and m.stopped.get("fail_fast") and (flags.errored or flags.restart):
            m.stopped = None  # its errored trials run again, and so may the others
            unmark_stopped(self.storage)
        for record in m.trials:
            if m.stopped is not None:
                break  # the sweep was ended (sweep_stop): nothing runs again
            if record.name in new:
                self.queue.append(record.name)
            elif record.status in sw.UNFINISHED and flags.unfinished:
                self.queue.append(record.name)
            elif record.status == sw.ERROR and (flags.restart or flags.errored):
                rerun(self.storage, record, flags.restart, self.population, self.scheduler)
                self.queue.append(record.name)
        self.save()
