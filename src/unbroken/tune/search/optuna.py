"""Optuna as a search algorithm, with its study inside the sweep directory.

The study is Optuna's journal of its operations, kept as files in the sweep directory (see
`optuna_journal`; on local disks and object stores alike), so it resumes exactly: a restored sweep
reopens the same study, adopts trials that were asked but never recorded in the sweep
manifest (the driver died in between), re-uses the recorded values of trials that were asked
but have not finished, and tells the outcome of trials that finished while no driver was
there to tell it. With the default sampler, each proposal uses a TPE sampler seeded by
(sweep seed, trial index), so proposals do not depend on a sampler's in-memory state either.

optuna is imported only when a sweep uses this searcher (`pip install 'unbroken[tune]'`).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

from unbroken.errors import SearchSpaceError
from unbroken.execution.engine.local import mark_clean, start_method
from unbroken.store.storage import Storage
from unbroken.store.sweep_manifest import TrialRecord, trial_name
from unbroken.tune import search_space as ss
from unbroken.tune.search.optuna_journal import study_storage
from unbroken.tune.search.searcher import SearchContext, Searcher, derive_seed

TRIAL_ATTR = "unbroken_trial"
RERUN_ATTR = "unbroken_rerun"


def _import_optuna() -> Any:
    if "optuna" in sys.modules:
        return sys.modules["optuna"]
    # Importing optuna imports numpy, whose BLAS starts idle threads that survive a fork (BLAS
    # libraries reset themselves in a forked child). If this process was fork-safe before the
    # import, it still is: say so, so trials keep being forked (see unbroken.execution.engine.local).
    was_clean = start_method() == "fork"
    try:
        import optuna
    except ImportError:
        raise ImportError("OptunaSearch needs optuna. Hint: pip install 'unbroken[tune]'") from None
    if was_clean:
        mark_clean()
    return optuna


@dataclass
class OptunaSearch(Searcher):
    """Propose trials with an Optuna study (TPE by default).

    `metric` and `mode` default to TuneConfig's. `sampler`: an Optuna sampler instance; with
    the default (None), every proposal uses `TPESampler(seed=...)` seeded by the sweep's seed
    and the trial index, which makes a restored sweep propose what an uninterrupted one
    would (given the same finished trials). A sampler of your own is used as it is.
    `study_name` defaults to the sweep's name.
    """

    metric: str | None = None
    mode: str | None = None
    sampler: Any = None
    study_name: str | None = None

    upfront = False

    def __post_init__(self) -> None:
        if self.mode not in (None, "min", "max"):
            raise ValueError(f"OptunaSearch mode must be 'min' or 'max', got {self.mode!r}")
        self._study: Any = None
        self._dists: dict[str, Any] = {}
        self._leaves: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_study=None, _dists={}, _leaves={})
        return state

    def describe(self) -> dict[str, Any]:
        sampler = None if self.sampler is None else type(self.sampler).__qualname__
        return {"kind": "optuna", "sampler": sampler, "study_name": self.study_name}

    def total(self, space: dict[str, Any], num_samples: int) -> int:
        for path, leaf in ss.leaves(space):
            if isinstance(leaf, ss.GridSearch):
                raise SearchSpaceError(
                    f"OptunaSearch cannot run grid_search (param_space[{path!r}]). Hint: use "
                    "choice([...]) with Optuna, or drop search_alg to run the grid")
        return num_samples

    def check(self, storage: Storage, metric: str | None, mode: str | None) -> None:
        _import_optuna()
        if metric is None or mode is None:
            raise ValueError("OptunaSearch needs a metric and a mode. Hint: TuneConfig(metric='loss', "
                             "mode='min') or OptunaSearch(metric=..., mode=...)")

    # -- the study ----------------------------------------------------------------------
    def open(self, ctx: SearchContext, records: list[TrialRecord]) -> list[tuple[dict[str, Any], Any]]:
        optuna = _import_optuna()
        self.check(ctx.storage, ctx.metric, ctx.mode)
        self._leaves = dict(ss.leaves(ctx.space))
        self._dists = {path: _distribution(path, leaf, optuna) for path, leaf in self._leaves.items()}
        self._study = optuna.create_study(
            storage=study_storage(ctx.storage, optuna), study_name=self.study_name or ctx.name,
            direction="maximize" if ctx.mode == "max" else "minimize", sampler=self.sampler,
            load_if_exists=True)
        known = {r.searcher_id for r in records if r.searcher_id is not None}
        running = optuna.trial.TrialState.RUNNING
        orphans = [t for t in self._study.get_trials(deepcopy=False)
                   if t.state == running and t.number not in known and RERUN_ATTR not in t.user_attrs]
        return [(self._stored(t.params), t.number) for t in sorted(orphans, key=lambda t: t.number)]

    def close(self) -> None:
        self._study = None

    def propose(self, ctx: SearchContext, index: int) -> tuple[dict[str, Any], Any]:
        optuna = _import_optuna()
        if self.sampler is None:
            self._study.sampler = optuna.samplers.TPESampler(seed=derive_seed(ctx.seed, index))
        trial = self._study.ask(self._dists)
        trial.set_user_attr(TRIAL_ATTR, trial_name(index))
        return self._stored(trial.params), trial.number

    def on_trial_complete(self, ctx: SearchContext, record: TrialRecord, metrics: dict[str, Any] | None,
                          error: bool) -> None:
        optuna = _import_optuna()
        states = optuna.trial.TrialState
        value = (metrics or {}).get(ctx.metric)
        ok = not error and isinstance(value, (int, float)) and math.isfinite(value)
        state = states.COMPLETE if ok else states.FAIL
        trials = self._study.get_trials(deepcopy=False)
        frozen = next((t for t in trials if t.number == record.searcher_id), None)
        if frozen is None:
            return
        if frozen.state == states.RUNNING:
            self._study.tell(frozen.number, float(value) if ok else None, state=state)
            return
        if record.reruns == 0:
            return  # told already (this is a repeated call after a crash)
        # A resumed or restarted errored trial: its first outcome was told already, so the new
        # outcome is added as a trial of its own with the same parameters, once.
        tag = f"{record.name}#{record.reruns}"
        if any(t.user_attrs.get(RERUN_ATTR) == tag for t in trials):
            return
        self._study.add_trial(optuna.trial.create_trial(
            params=frozen.params, distributions=frozen.distributions, value=float(value) if ok else None,
            state=state, user_attrs={TRIAL_ATTR: record.name, RERUN_ATTR: tag}))

    def _stored(self, params: dict[str, Any]) -> dict[str, Any]:
        """Optuna parameters as the sweep's stored values (choice: the index)."""
        return {path: params[path] for path in self._leaves}


def _distribution(path: str, leaf: Any, optuna: Any) -> Any:
    d = optuna.distributions
    if isinstance(leaf, ss.Float):
        if leaf.log and leaf.q is not None:
            raise SearchSpaceError(f"OptunaSearch cannot sample param_space[{path!r}]: a log domain with "
                                   "q. Hint: use loguniform without q")
        return d.FloatDistribution(leaf.lower, leaf.upper, log=leaf.log, step=leaf.q)
    if isinstance(leaf, ss.Integer):
        if leaf.log and leaf.q > 1:
            raise SearchSpaceError(f"OptunaSearch cannot sample param_space[{path!r}]: a log int domain "
                                   "with q. Hint: use lograndint without q")
        return d.IntDistribution(leaf.lower, leaf.high, log=leaf.log, step=leaf.q)
    if isinstance(leaf, ss.Categorical):
        return d.CategoricalDistribution(list(range(len(leaf.categories))))
    raise SearchSpaceError(f"OptunaSearch cannot sample param_space[{path!r}] ({leaf.spec()}). Hint: use "
                           "uniform, loguniform, randint or choice with Optuna")
