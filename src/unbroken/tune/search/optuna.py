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
CONSTANTS_ATTR = "unbroken_constants"  # what a define-by-run function returned for a trial


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
    would (given the same finished trials); `seed` (Ray's) seeds them instead of the sweep's
    seed. A sampler of your own is used as it is. `study_name` defaults to the sweep's name.

    `space`, as in Ray, instead of the param_space's domains: a dict of Optuna distributions
    by parameter name, or a define-by-run function `space(trial)` that calls
    `trial.suggest_*` and may return a dict of constants for the config. Its parameters go
    into each trial's config at their names ("a/b" is `config["a"]["b"]`), beside the
    param_space's constants. `metric` and `mode` as lists (`["loss", "acc"]`, `["min",
    "max"]`) make the study multi-objective; the sweep's own metric (for its best result)
    stays TuneConfig's.
    """

    space: Any = None
    metric: str | list[str] | None = None
    mode: str | list[str] | None = None
    points_to_evaluate: list[dict[str, Any]] | None = None
    sampler: Any = None
    study_name: str | None = None
    seed: int | None = None
    evaluated_rewards: list[Any] | None = None

    upfront = False

    def __post_init__(self) -> None:
        modes = self.mode if isinstance(self.mode, list) else [self.mode]
        if any(m not in (None, "min", "max") for m in modes):
            raise ValueError(f"OptunaSearch mode must be 'min' or 'max' (or a list of them), got "
                             f"{self.mode!r}")
        if isinstance(self.metric, list) != isinstance(self.mode, list) or (
                isinstance(self.metric, list) and len(self.metric) != len(self.mode)):
            raise ValueError(f"OptunaSearch with several objectives needs a metric list and a mode list "
                             f"of the same length, got metric={self.metric!r}, mode={self.mode!r}")
        if self.space is not None and not (callable(self.space) or isinstance(self.space, dict)):
            raise ValueError(f"OptunaSearch space must be a dict of Optuna distributions or a define-by-run "
                             f"function of the trial, got {self.space!r}")
        if self.points_to_evaluate or self.evaluated_rewards:
            raise ValueError("OptunaSearch(points_to_evaluate=..., evaluated_rewards=...) is not supported. "
                             "Hint: run those configs as a sweep of their own (grid_search over them)")
        self._study: Any = None
        self._dists: dict[str, Any] = {}
        self._leaves: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_study=None, _dists={}, _leaves={})
        return state

    def describe(self) -> dict[str, Any]:
        sampler = None if self.sampler is None else type(self.sampler).__qualname__
        out = {"kind": "optuna", "sampler": sampler, "study_name": self.study_name}
        if self.space is not None:
            function = f"{getattr(self.space, '__module__', '')}.{getattr(self.space, '__qualname__', '')}"
            out["space"] = function if callable(self.space) else sorted(self.space)
        if self.seed is not None:
            out["seed"] = self.seed
        if isinstance(self.metric, list):
            out["objectives"] = list(zip(self.metric, self.mode, strict=True))
        return out

    def total(self, space: dict[str, Any], num_samples: int) -> int:
        for path, leaf in ss.leaves(space):
            if self.space is not None:
                raise SearchSpaceError(
                    f"OptunaSearch(space=...) proposes the parameters itself, and the param_space has a "
                    f"search-space value at {path!r}. Hint: put every parameter in one of the two")
            if isinstance(leaf, ss.GridSearch):
                raise SearchSpaceError(
                    f"OptunaSearch cannot run grid_search (param_space[{path!r}]). Hint: use "
                    "choice([...]) with Optuna, or drop search_alg to run the grid")
        return num_samples

    def check(self, storage: Storage, metric: str | None, mode: str | None) -> None:
        _import_optuna()
        if isinstance(self.metric, list):
            return
        if metric is None or mode is None:
            raise ValueError("OptunaSearch needs a metric and a mode. Hint: TuneConfig(metric='loss', "
                             "mode='min') or OptunaSearch(metric=..., mode=...)")

    # -- the study ----------------------------------------------------------------------
    def open(self, ctx: SearchContext, records: list[TrialRecord]) -> list[tuple[dict[str, Any], Any]]:
        optuna = _import_optuna()
        self.check(ctx.storage, ctx.metric, ctx.mode)
        self._leaves = dict(ss.leaves(ctx.space))
        self._dists = {path: _distribution(path, leaf, optuna) for path, leaf in self._leaves.items()}
        if isinstance(self.space, dict):
            self._dists = dict(self.space)
        modes = self.mode if isinstance(self.mode, list) else [ctx.mode]
        self._study = optuna.create_study(
            storage=study_storage(ctx.storage, optuna), study_name=self.study_name or ctx.name,
            directions=["maximize" if m == "max" else "minimize" for m in modes], sampler=self.sampler,
            load_if_exists=True)
        known = {r.searcher_id for r in records if r.searcher_id is not None}
        running = optuna.trial.TrialState.RUNNING
        orphans = [t for t in self._study.get_trials(deepcopy=False)
                   if t.state == running and t.number not in known and RERUN_ATTR not in t.user_attrs]
        return [(self._stored(t.params, t.user_attrs.get(CONSTANTS_ATTR)), t.number)
                for t in sorted(orphans, key=lambda t: t.number)]

    def close(self) -> None:
        self._study = None

    def propose(self, ctx: SearchContext, index: int) -> tuple[dict[str, Any], Any]:
        optuna = _import_optuna()
        if self.sampler is None:
            base = self.seed if self.seed is not None else ctx.seed
            self._study.sampler = optuna.samplers.TPESampler(seed=derive_seed(base, index))
        if callable(self.space):  # define-by-run: the function suggests the parameters
            trial = self._study.ask()
            constants = self.space(trial) or {}
            if not isinstance(constants, dict):
                raise TypeError(f"OptunaSearch's define-by-run function returned {constants!r}. Hint: "
                                "return None, or a dict of constants for the config")
            trial.set_user_attr(CONSTANTS_ATTR, constants)
        else:
            trial, constants = self._study.ask(self._dists), None
        trial.set_user_attr(TRIAL_ATTR, trial_name(index))
        return self._stored(trial.params, constants), trial.number

    def on_trial_complete(self, ctx: SearchContext, record: TrialRecord, metrics: dict[str, Any] | None,
                          error: bool) -> None:
        optuna = _import_optuna()
        states = optuna.trial.TrialState
        names = self.metric if isinstance(self.metric, list) else [ctx.metric]
        values = [(metrics or {}).get(name) for name in names]
        ok = not error and all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)
        state = states.COMPLETE if ok else states.FAIL
        value = ([float(v) for v in values] if len(values) > 1 else float(values[0])) if ok else None
        trials = self._study.get_trials(deepcopy=False)
        frozen = next((t for t in trials if t.number == record.searcher_id), None)
        if frozen is None:
            return
        if frozen.state == states.RUNNING:
            self._study.tell(frozen.number, value, state=state)
            return
        if record.reruns == 0:
            return  # told already (this is a repeated call after a crash)
        # A resumed or restarted errored trial: its first outcome was told already, so the new
        # outcome is added as a trial of its own with the same parameters, once.
        tag = f"{record.name}#{record.reruns}"
        if any(t.user_attrs.get(RERUN_ATTR) == tag for t in trials):
            return
        self._study.add_trial(optuna.trial.create_trial(
            params=frozen.params, distributions=frozen.distributions,
            **({"values": value} if isinstance(value, list) else {"value": value}),
            state=state, user_attrs={**frozen.user_attrs, TRIAL_ATTR: record.name, RERUN_ATTR: tag}))

    def _stored(self, params: dict[str, Any], constants: dict[str, Any] | None = None) -> dict[str, Any]:
        """Optuna parameters as the sweep's stored values (choice: the index); with `space`,
        the parameters (and the define-by-run function's constants) as they are."""
        if self.space is not None:
            return {**params, **(constants or {})}
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
