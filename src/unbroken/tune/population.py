"""Population-based training in a sweep: where its decisions are made, recorded and applied.

1. **Pause.** Each trial's `RunConfig.stop` is a `PBTStopper`. At the first row at or past the
   trial's next perturbation point that carries a committed checkpoint, it records the pause
   (`.unbroken/pbt/rounds/<trial>-<round>.json`: round, point, score, checkpoint; and the latest
   in `paused/<trial>.json`) and stops the trial.
   Its run ends FINISHED; the sweep driver sees the pause and marks the trial PAUSED.
2. **Decide.** The sweep driver (the one process that holds the sweep's lease) decides for a
   paused trial at once, from the latest score of every trial, or with `synch=True` once every
   unfinished trial has paused at the same round, from the scores of that round (so the
   decision does not depend on when the trials got there): a trial in the bottom quantile
   exploits one of the top quantile (`pbt.quantiles`), drawn with a generator seeded by
   (sweep seed, trial, round), and explores the donor's config (the scheduler's `new_config`:
   `pbt.explore`, or PB2's bandit, `pb2`, from the same generator). The decision
   is written before anything is done about it (`decisions/<trial>-<round>.json`), so a driver
   killed at any moment after that applies the same decision when the sweep is restored.
3. **Apply.** An exploit copies the donor's checkpoint into the trial's run as a committed
   checkpoint at the donor's iteration, deleting the trial's own checkpoints from that
   iteration on first (its lineage is replaced), and appends the exploit to the trial's
   lineage (`<trial>/.unbroken/pbt.json`, which `unbroken show` prints). Every step is
   idempotent. Last, `state/<trial>.json` records the round as handled, the next point and
   the trial's config overrides; the trial is then run again: its run continues from the
   newest checkpoint (the clone, or its own) with the new config, as a new attempt.
"""

from __future__ import annotations

import json
import math
import os
import random
import tempfile
import time
from collections.abc import Callable
from typing import Any

from unbroken.core import faults
from unbroken.core.config import stop_due_at, stop_met, stop_met_at_resume
from unbroken.errors import TornCheckpointError
from unbroken.store import commit
from unbroken.store import manifest as mf
from unbroken.store import sweep_manifest as sw
from unbroken.store.commit import Marker
from unbroken.store.manifest import META_DIR
from unbroken.store.storage import Storage
from unbroken.tune import pbt
from unbroken.tune.pbt import PopulationBasedTraining
from unbroken.tune.records import finite_number, last_kept_row, read_record

PBT_DIR = f"{META_DIR}/pbt"
LINEAGE = mf.PBT_LINEAGE  # in a trial's run directory


def state(storage: Storage, trial: str, scheduler: PopulationBasedTraining) -> dict[str, Any]:
    """The trial's handled round, its next perturbation point and its config overrides."""
    return read_record(storage, f"{PBT_DIR}/state/{trial}.json") or {
        "round": 0, "next": scheduler.first_point(), "overrides": {}}


def pending(storage: Storage, trial: str, scheduler: PopulationBasedTraining) -> dict[str, Any] | None:
    """The trial's pause that no decision has handled yet, if any."""
    paused = read_record(storage, f"{PBT_DIR}/paused/{trial}.json")
    if paused is None or paused["round"] <= state(storage, trial, scheduler)["round"]:
        return None
    return paused


def finished_status(storage: Storage, trial: str, scheduler: PopulationBasedTraining, run: Any) -> str:
    """The sweep status of a trial whose run is FINISHED: PAUSED with a pause to decide,
    PENDING when its last pause was decided after its last attempt began (it must run again),
    else TERMINATED."""
    if pending(storage, trial, scheduler) is not None:
        return sw.PAUSED
    handled = state(storage, trial, scheduler).get("handled_at")
    if handled is not None and run.attempts and run.attempts[-1].started_at < handled:
        return sw.PENDING
    return sw.TERMINATED


class PBTStopper:
    """The `RunConfig.stop` of one trial of a PBT sweep: its own stop condition, then the pause
    at its next perturbation point (see the module docstring)."""

    def __init__(self, trial: str, sweep_url: str, storage_filesystem: Any,
                 scheduler: PopulationBasedTraining, metric: str | None, user_stop: Any = None) -> None:
        self.trial, self.sweep_url, self.storage_filesystem = trial, sweep_url, storage_filesystem
        self.scheduler, self.metric, self.user_stop = scheduler, metric, user_stop
        self._state: dict[str, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_state": None}

    def __repr__(self) -> str:
        return f"PBTStopper(trial={self.trial!r}, user_stop={self.user_stop!r})"

    def verdict_from(self) -> int | None:
        """The iteration of the next perturbation point, when the time is counted in
        iterations: a rank waits there for the pause instead of running one more iteration
        (see `config.stop_due_at`); the user's own stop, if it says, when it comes first."""
        user = stop_due_at(self.user_stop)
        if self.scheduler.time_attr != "training_iteration":
            return user
        if self._state is None:
            self._state = state(Storage.from_url(self.sweep_url, self.storage_filesystem), self.trial,
                                self.scheduler)
        ours = math.ceil(self._state["next"])
        return ours if user is None else min(ours, user)

    def met_at_resume(self, row: dict[str, Any]) -> bool:
        """The trial's own stop, at the row it resumes from (a pause there is the sweep
        driver's to catch up: `Population.catch_up`)."""
        return stop_met_at_resume(self.user_stop, row)

    def __call__(self, row: dict[str, Any]) -> bool:
        if stop_met(self.user_stop, row):
            return True
        t = row.get(self.scheduler.time_attr)
        if not finite_number(t):
            return False
        storage = Storage.from_url(self.sweep_url, self.storage_filesystem)
        if self._state is None:
            self._state = state(storage, self.trial, self.scheduler)
        if t < self._state["next"] or not row.get("checkpoint_dir_name"):
            return False
        record_pause(storage, self.trial, self._state["round"] + 1, row, self.metric, t)
        return True


def record_pause(storage: Storage, trial: str, n: int, row: dict[str, Any], metric: str | None,
                 t: float) -> None:
    """Record that `trial` paused for round `n` at `row` (its time `t`)."""
    score = row.get(metric) if metric else None
    pause = {"round": n, "t": t, "score": score if finite_number(score) else None,
             "checkpoint": row["checkpoint_dir_name"], "iteration": row["training_iteration"]}
    storage.makedirs(f"{PBT_DIR}/rounds")
    storage.write_json(f"{PBT_DIR}/rounds/{trial}-{n:04d}.json", pause)  # what round n decides on
    storage.makedirs(f"{PBT_DIR}/paused")
    storage.write_json(f"{PBT_DIR}/paused/{trial}.json", pause)  # the latest, marking it pending


class Population:
    """The sweep driver's side of PBT: decisions and their application (module docstring).
    `config_of(trial, with_overrides)`: the trial's config, as sampled and, with
    `with_overrides`, as PBT changed it since."""

    def __init__(self, storage: Storage, scheduler: PopulationBasedTraining, metric: str, mode: str,
                 seed: int, config_of: Callable[[str, bool], dict[str, Any]]) -> None:
        self.storage, self.scheduler, self.metric, self.mode = storage, scheduler, metric, mode
        self.seed, self.config_of = seed, config_of

    def pending(self, trial: str) -> dict[str, Any] | None:
        return pending(self.storage, trial, self.scheduler)

    def trial_stopper(self, stop: Any, metric: str | None) -> PBTStopper:
        """The stop of a trial (`stop`: its `sweep_stop.TrialStop`) with its pause; refuses a
        config the scheduler cannot explore (`check_config`) before the trial runs."""
        self.scheduler.check_config(self.config_of(stop.trial, False))
        return PBTStopper(stop.trial, stop.sweep_url, stop.storage_filesystem, self.scheduler, metric, stop)

    def catch_up(self, trial: str, user_stop: Any = None) -> None:
        """A trial whose driver died after recording the row of its pause, before recording
        the pause itself: record it now, from that row (its checkpoint committed), so the
        trial pauses there as it would have, rather than past it. A row that met the trial's
        own stop (`user_stop`) is no pause: `PBTStopper` checks that first, and the trial
        finished there."""
        st, run = state(self.storage, trial, self.scheduler), self.storage.child(trial)
        if self.pending(trial) is not None or not mf.is_run_dir(run):
            return
        last = last_kept_row(run)  # a row whose checkpoint did not commit is redone, and pauses then
        t, name = last.get(self.scheduler.time_attr), last.get("checkpoint_dir_name")
        if not (finite_number(t) and t >= st["next"] and name) or stop_met(user_stop, last):
            return
        record_pause(self.storage, trial, st["round"] + 1, last, self.metric, t)

    def forget(self, trial: str) -> None:
        """Remove the trial's pauses, decisions and state (it is restarted from scratch)."""
        for folder in ("rounds", "decisions"):
            for name in self.storage.listdir(f"{PBT_DIR}/{folder}"):
                if name.startswith(f"{trial}-"):
                    self.storage.remove(f"{PBT_DIR}/{folder}/{name}")
        self.storage.remove(f"{PBT_DIR}/paused/{trial}.json")
        self.storage.remove(f"{PBT_DIR}/state/{trial}.json")

    def overrides(self, trial: str) -> dict[str, Any]:
        return state(self.storage, trial, self.scheduler)["overrides"]

    def _pause(self, trial: str, n: int | None = None) -> dict[str, Any] | None:
        """The trial's pause of round `n`, or its latest."""
        rel = f"{PBT_DIR}/rounds/{trial}-{n:04d}.json" if n is not None else f"{PBT_DIR}/paused/{trial}.json"
        return read_record(self.storage, rel)

    def scores(self, n: int | None) -> dict[str, float]:
        """Each trial's score at its pause of round `n` (synch), or at its latest pause."""
        out = {}
        for name in self.storage.listdir(f"{PBT_DIR}/paused"):
            trial = name[:-5]
            pause = self._pause(trial, n) if name.endswith(".json") else None
            if pause and finite_number(pause.get("score")):
                out[trial] = float(pause["score"])
        return out

    def ready(self, trial: str, unfinished: list[str]) -> bool:
        """Whether the paused trial can be decided for and run again now: at once, unless
        `synch` and some unfinished trial has not yet paused at the same round (a decision
        recorded before is applied at once)."""
        paused = self.pending(trial)
        if paused is None or not self.scheduler.synch:
            return True
        n = paused["round"]
        if self.storage.exists(f"{PBT_DIR}/decisions/{trial}-{n:04d}.json"):
            return True
        return all((self._pause(other) or {"round": 0})["round"] >= n for other in unfinished)

    def decide(self, trial: str) -> dict[str, Any]:
        """Decide for the trial's pending pause (or read the decision made before), apply it and
        record the round as handled. Returns the decision."""
        paused = self.pending(trial)
        assert paused is not None, trial
        n = paused["round"]
        rel = f"{PBT_DIR}/decisions/{trial}-{n:04d}.json"
        decision = read_record(self.storage, rel)
        if decision is None:
            faults.point("pbt_deciding")  # crash tests: paused, nothing chosen yet (chosen again)
            decision = self._choose(trial, paused)
            self.storage.makedirs(f"{PBT_DIR}/decisions")
            self.storage.write_json(rel, decision)
        faults.point("pbt_decided")  # crash tests: chosen and recorded, not yet applied
        if decision["action"] == "exploit":
            why_not = self._clone(decision["donor"], decision["checkpoint"], trial, n)
            if why_not is not None:
                decision = {"round": n, "t": paused["t"], "action": "continue", "why": why_not}
                self.storage.write_json(rel, decision)
            else:
                self._record_lineage(trial, decision)
        overrides = decision.get("overrides", self.overrides(trial))
        self.storage.makedirs(f"{PBT_DIR}/state")
        self.storage.write_json(f"{PBT_DIR}/state/{trial}.json", {
            "round": n, "next": paused["t"] + self.scheduler.perturbation_interval, "overrides": overrides,
            "handled_at": time.time()})
        return decision

    def _choose(self, trial: str, paused: dict[str, Any]) -> dict[str, Any]:
        n, t = paused["round"], paused["t"]
        rng = random.Random(f"{self.seed}:{trial}:{n}")
        at = n if self.scheduler.synch else None
        bottom, top = pbt.quantiles(self.scores(at), self.scheduler.quantile_fraction, self.mode)
        if trial not in bottom or not top:
            return {"round": n, "t": t, "action": "continue"}
        donor = rng.choice(top)
        donor_paused = self._pause(donor, at)
        exploit = pbt.Exploit(trial, donor, n, at, self.config_of(donor, True), donor_paused, self)
        new_config = self.scheduler.new_config(exploit, rng)
        overrides = pbt.differences(self.config_of(trial, False), new_config)
        try:
            json.dumps(overrides)
        except (TypeError, ValueError) as e:
            raise ValueError(f"PopulationBasedTraining: the explored config of {trial} is not plain data "
                             f"({e}). Hint: hyperparam_mutations and custom_explore_fn must give numbers, "
                             "strings, lists or dicts") from None
        return {"round": n, "t": t, "action": "exploit", "donor": donor,
                "checkpoint": donor_paused["checkpoint"], "score": paused["score"],
                "donor_score": donor_paused["score"], "donor_t": donor_paused["t"],
                "old_config": _plain(self.config_of(trial, True)), "new_config": _plain(new_config),
                "overrides": overrides}

    def _clone(self, donor: str, name: str, trial: str, n: int) -> str | None:
        """Copy checkpoint `name` of `donor` into `trial`'s run as its newest committed
        checkpoint; None when done, else why it could not be."""
        source, target = self.storage.child(donor), self.storage.child(trial)
        try:
            marker = commit.verify(source, name, full=True)
        except TornCheckpointError as e:
            return f"the checkpoint {donor}/{name} is gone or torn ({e})"
        k = marker.iteration
        for own in commit.scan(target)[0]:
            try:
                if commit.read_marker(target, own).iteration >= k:
                    commit.uncommit_and_delete(target, own)
            except TornCheckpointError:
                continue
        attempt = mf.load(target).attempt_count if mf.is_run_dir(target) else 0
        staging = commit.staging_name(k, attempt, target)
        with tempfile.TemporaryDirectory(prefix="unbroken-pbt-") as local:
            for f in marker.files:
                copy = os.path.join(local, f.path)
                source.get_file(f"{name}/{f.path}", copy)
                target.put_file(copy, f"{staging}/{f.path}")
        clone = Marker(name=commit.checkpoint_name(k), iteration=k, attempt=attempt, files=marker.files,
                              metrics=marker.metrics, committed_at=time.time())
        commit.commit(target, staging, clone)
        faults.point("pbt_cloned")  # crash tests: cloned, the round not yet recorded as handled
        return None

    def _record_lineage(self, trial: str, decision: dict[str, Any]) -> None:
        run = self.storage.child(trial)
        lineage = read_record(run, LINEAGE) or []
        if not any(entry["round"] == decision["round"] for entry in lineage):
            kept = ("round", "t", "donor", "checkpoint", "score", "donor_score", "old_config", "new_config")
            lineage.append({k: decision[k] for k in kept})
            run.write_json(LINEAGE, lineage)


def _plain(config: Any) -> Any:
    return json.loads(json.dumps(config, default=repr))
