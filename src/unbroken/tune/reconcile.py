"""How far an unfinished trial got, as its run directory has it.

A sweep driver that stopped (killed, say, after a trial's run recorded its end but before the
sweep manifest did) leaves the manifest behind the runs, and each run's own manifest is the
authority on how far it got. A restore reconciles the two before anything else.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from unbroken.errors import UnbrokenError
from unbroken.store import manifest as mf
from unbroken.store import sweep_manifest as sw
from unbroken.store.storage import Storage
from unbroken.store.sweep_manifest import TrialRecord
from unbroken.tune import asha, hyperband, population
from unbroken.tune.hyperband import HyperBandScheduler
from unbroken.tune.pbt import PopulationBasedTraining

log = logging.getLogger("unbroken")


def reconciled(storage: Storage, record: TrialRecord, scheduler: Any) -> TrialRecord:
    """An unfinished trial's record as its run directory has it (see the module docstring):
    FINISHED -> TERMINATED, ERRORED -> ERROR, anything else (INTERRUPTED, or RUNNING with its
    driver gone) -> INTERRUPTED, no run yet -> PENDING; a trial the scheduler stopped is
    TERMINATED; with population-based training or HyperBand, a FINISHED run that paused is
    PAUSED, and PENDING once the pause was decided and before it ran again; one that ended is due
    to be told to the sweep callbacks. A finished trial's record is returned as it is. Reads
    only: the caller decides whether to record the result (only the driver holding the sweep's
    lease writes)."""
    if record.status in sw.DONE:
        return record
    out = dataclasses.replace(record)
    decision = asha.read_decision(storage, record.name) if isinstance(scheduler, asha.ASHAScheduler) else None
    trial = storage.child(record.name)
    if decision is not None:
        out.status, out.stopped_early = sw.TERMINATED, asha.describe_decision(decision)
    elif isinstance(scheduler, HyperBandScheduler) and (cut := hyperband.stopped(storage, record.name)):
        out.status, out.stopped_early = sw.TERMINATED, hyperband.describe_stop(cut)
    elif _paused(storage, record.name, scheduler):
        out.status = sw.PAUSED  # it paused, whether or not its driver lived to record its run's end
    elif not mf.is_run_dir(trial):
        if out.status == sw.RUNNING:
            out.status = sw.PENDING
    else:
        try:
            run = mf.load(trial)
        except (UnbrokenError, OSError) as e:
            out.status, out.error = sw.ERROR, f"{type(e).__name__}: {e}".splitlines()[0]
            return out
        if run.status == mf.FINISHED and isinstance(scheduler, PopulationBasedTraining):
            out.status, out.error = population.finished_status(storage, record.name, scheduler, run), None
        elif run.status == mf.FINISHED and isinstance(scheduler, HyperBandScheduler):
            out.status, out.error = hyperband.finished_status(storage, record.name, run), None
        elif run.status == mf.FINISHED:
            out.status, out.error = sw.TERMINATED, None
        elif run.status == mf.ERRORED:
            out.status = sw.ERROR
            out.error = next((a.error for a in reversed(run.attempts) if a.error), "the run is ERRORED")
        else:
            out.status = sw.INTERRUPTED
    if out.status in sw.DONE:
        out.ended_at = out.ended_at or time.time()
        out.end_due = True  # the sweep callbacks were not told (tune.callback)
    return out


def _paused(storage: Storage, trial: str, scheduler: Any) -> bool:
    """Whether the trial has a pause no decision has handled (PBT, HyperBand)."""
    if isinstance(scheduler, PopulationBasedTraining):
        return population.pending(storage, trial, scheduler) is not None
    return isinstance(scheduler, HyperBandScheduler) and hyperband.pending(storage, trial) is not None


def rerun(storage: Storage, record: TrialRecord, restart: bool, pbt: Any, scheduler: Any) -> None:
    """An errored trial runs again (Tuner.restore(resume_errored=True or restart_errored=True)):
    resumed from its checkpoints, or restarted from scratch with its old run directory kept
    under .unbroken/restarted/ and what the scheduler (`pbt`: a sweep's `Population`) recorded
    for it forgotten."""
    record.reruns += 1
    if restart:
        record.restarts += 1
        if storage.exists(record.name):
            storage.makedirs(sw.RESTARTED_DIR)
            aside = f"{sw.RESTARTED_DIR}/{record.name}.{record.restarts}"
            storage.rename(record.name, aside)
            log.info("sweep %s: %s restarts from scratch; its old run is kept in %s", storage.url(),
                     record.name, aside)
        # A new run: what the sweep callbacks are told of it starts again (tune.callback).
        record.results_seen, record.saves_seen, record.restores_seen, record.recovers_seen = 0, None, 0, 0
        if pbt is not None:
            pbt.forget(record.name)
            record.overrides = None
        elif scheduler is not None:
            asha.forget_trial(storage, record.name)
    record.status, record.error, record.stopped_early, record.told = sw.PENDING, None, None, False
