"""PB2, Population Based Bandits (Ray Tune's `PB2`): population-based training whose explore
step is learned. Pauses, exploits, their records and their application are
`PopulationBasedTraining`'s (see `population`); only the new config of an exploiting trial
differs: its hyperparameters of `hyperparam_bounds` are chosen by a Gaussian-process bandit
(`pb2_bandit`) fitted to what the population's records say each config gained.

What the bandit learns from is read back from those records (`stretches`), never from memory:
each pause of a trial ends a stretch of training that began at its previous pause (or, after
an exploit, at the donor's pause it took over), trained with the config the trial's decisions
gave it by then. With `synch=True` a decision at round n reads only the pauses of rounds up to
n and the decisions of earlier rounds, all written before any decision of round n, so a killed
and restored sweep that decides again chooses the same values; and a decision once recorded is
applied as recorded.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from unbroken.errors import SearchSpaceError
from unbroken.store.storage import Storage
from unbroken.tune import pb2_bandit, pbt
from unbroken.tune.pbt import Exploit, PopulationBasedTraining
from unbroken.tune.population import PBT_DIR
from unbroken.tune.records import finite_number, read_record

_BOUNDS_HINT = "Hint: PB2(hyperparam_bounds={'lr': [1e-4, 1e-1]}): [low, high] of each continuous one"


@dataclass(init=False)
class PB2(PopulationBasedTraining):
    """Population Based Bandits: every `perturbation_interval` of `time_attr`, a trial in the
    bottom `quantile_fraction` by `metric` takes over the latest checkpoint of a trial in the
    top one, as with PopulationBasedTraining, and continues with the donor's config in which
    each hyperparameter of `hyperparam_bounds` (name, or nested dict of names, -> [low, high])
    is chosen within its bounds by a Gaussian-process bandit over what the population gained
    with each config so far (see `pb2_bandit`); an int keeps being an int. `custom_explore_fn`
    takes that config and returns the one to use. Needs scikit-learn (`pip install
    'unbroken[pb2]'`)."""

    hyperparam_bounds: dict[str, Any] = field(default_factory=dict)
    # PopulationBasedTraining's settings that PB2 does not take: fixed, neither arguments nor saved
    burn_in_period: float = field(default=0.0, init=False, repr=False)
    hyperparam_mutations: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    resample_probability: float = field(default=0.0, init=False, repr=False)
    perturbation_factors: tuple[float, float] = field(default=(1.2, 0.8), init=False, repr=False)

    def __init__(self, time_attr: str = "time_total_s", metric: str | None = None, mode: str | None = None,
                 perturbation_interval: float = 60.0, hyperparam_bounds: dict[str, Any] | None = None,
                 quantile_fraction: float = 0.25, log_config: bool = True, require_attrs: bool = True,
                 synch: bool = False,
                 custom_explore_fn: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
        """Ray Tune's signature; SearchSpaceError for missing or bad bounds, MissingDependencyError
        without scikit-learn (both before any sweep starts)."""
        self.time_attr, self.metric, self.mode = time_attr, metric, mode
        self.perturbation_interval, self.quantile_fraction = perturbation_interval, quantile_fraction
        self.hyperparam_bounds = hyperparam_bounds if hyperparam_bounds is not None else {}
        self.log_config, self.require_attrs, self.synch = log_config, require_attrs, synch
        self.custom_explore_fn = custom_explore_fn
        self.burn_in_period, self.hyperparam_mutations, self.resample_probability = 0.0, {}, 0.0
        self.perturbation_factors = (1.2, 0.8)
        self._check_settings()
        self.bounds()
        pb2_bandit.require_sklearn()

    def bounds(self) -> list[tuple[str, float, float]]:
        """(path, low, high) of each hyperparameter PB2 chooses; SearchSpaceError when
        `hyperparam_bounds` is empty or a bound is not two numbers with low < high."""
        if not isinstance(self.hyperparam_bounds, dict) or not self.hyperparam_bounds:
            raise SearchSpaceError(f"PB2 needs hyperparam_bounds, got {self.hyperparam_bounds!r}. "
                                   f"{_BOUNDS_HINT}")
        out = []
        for path, bound in pbt.leaves(self.hyperparam_bounds):
            if not (isinstance(bound, (list, tuple)) and len(bound) == 2 and all(map(finite_number, bound))):
                raise SearchSpaceError(f"PB2 hyperparam_bounds[{path!r}] must be [low, high], two numbers, "
                                       f"got {bound!r}. {_BOUNDS_HINT}")
            low, high = float(bound[0]), float(bound[1])
            if not low < high:
                raise SearchSpaceError(f"PB2 hyperparam_bounds[{path!r}] must have low < high, got "
                                       f"{bound!r}. Hint: [{min(low, high)}, {max(low, high)}]; a value PB2 "
                                       "should not change stays out of hyperparam_bounds")
            out.append((path, low, high))
        return out

    def check_space(self, param_space: dict[str, Any]) -> None:
        """SearchSpaceError when `hyperparam_bounds` names a key `param_space` does not hold (a
        trial would have no starting value there)."""
        for path, _, _ in self.bounds():
            if pbt.value_at(param_space, path) is None:
                raise SearchSpaceError(
                    f"PB2 hyperparam_bounds names {path!r}, which param_space does not hold. Hint: give "
                    f"{path!r} a starting value in param_space (e.g. tune.uniform(low, high)), or leave "
                    "it out of hyperparam_bounds")

    def check_config(self, config: dict[str, Any]) -> None:
        """SearchSpaceError unless the trial's sampled `config` holds a number at each path of
        `hyperparam_bounds` (PB2 explores only what the trial has)."""
        for path, _, _ in self.bounds():
            value = pbt.value_at(config, path)
            if not finite_number(value):
                held = "has no such key" if value is None else f"holds {value!r}, not a number"
                raise SearchSpaceError(
                    f"PB2 hyperparam_bounds names {path!r}, but the trial's config {held}. Hint: give "
                    f"{path!r} a starting number in param_space (e.g. tune.uniform(low, high)), or "
                    "leave it out of hyperparam_bounds")

    def new_config(self, exploit: Exploit, rng: random.Random) -> dict[str, Any]:
        """The donor's config with the bandit's values for `hyperparam_bounds` (within them;
        rounded where the donor's value is an int), then through `custom_explore_fn`."""
        bounds = self.bounds()
        paths = [path for path, _, _ in bounds]
        sign = 1.0 if exploit.population.mode == "max" else -1.0
        data = stretches(exploit.population.storage, exploit.population.config_of, paths, sign, exploit.at)
        start = (float(exploit.donor_pause["t"]), sign * float(exploit.donor_pause["score"]))
        values = pb2_bandit.select(data, start, [(low, high) for _, low, high in bounds], rng)
        chosen: dict[str, Any] = {}
        for (path, low, high), value in zip(bounds, values, strict=True):
            old = pbt.value_at(exploit.donor_config, path)
            whole = isinstance(old, int) and not isinstance(old, bool)
            chosen[path] = min(max(round(value), math.ceil(low)), math.floor(high)) if whole else value
        out = pbt.apply(exploit.donor_config, chosen)
        return self.custom_explore_fn(out) if self.custom_explore_fn is not None else out

    def describe(self) -> dict[str, Any]:
        """PBT's description (sweep.json's `scheduler`, part of the sweep's identity) without
        the settings PB2 fixes, with its bounds."""
        out = super().describe()
        for fixed in ("burn_in_period", "hyperparam_mutations", "resample_probability",
                      "perturbation_factors"):
            del out[fixed]
        bounds = {path: [low, high] for path, low, high in self.bounds()}
        return {**out, "kind": "pb2", "hyperparam_bounds": bounds}


def stretches(storage: Storage, config_of: Callable[[str, bool], dict[str, Any]], paths: list[str],
              sign: float, at: int | None) -> list[pb2_bandit.Stretch]:
    """Every stretch of training the population's records show (module docstring), in time
    order: the pauses of rounds up to `at` and the decisions before it (all of them when `at`
    is None); reward is `sign` times the score; the values are those at `paths` of the config
    the trial trained with (`config_of(trial, False)` as sampled, with the overrides of its
    latest exploit before)."""
    pauses = _by_trial(storage, "rounds", at)
    decisions = _by_trial(storage, "decisions", None if at is None else at - 1)
    out: list[pb2_bandit.Stretch] = []
    for trial in sorted(pauses):
        sampled, overrides, start = config_of(trial, False), {}, None
        for n in sorted(pauses[trial]):
            pause, config = pauses[trial][n], pbt.apply(sampled, overrides)
            values = [pbt.value_at(config, path) for path in paths]
            if start is not None and finite_number(pause["score"]) and all(map(finite_number, values)) \
                    and pause["t"] > start[0]:
                gain = (sign * pause["score"] - start[1]) / (pause["t"] - start[0])
                out.append((start[0], start[1], [float(v) for v in values], gain))
            start = (pause["t"], sign * pause["score"]) if finite_number(pause["score"]) else None
            decision = decisions.get(trial, {}).get(n)
            if decision is not None and decision["action"] == "exploit":
                overrides = decision["overrides"]
                donor_t, donor_score = decision.get("donor_t", decision["t"]), decision["donor_score"]
                start = (donor_t, sign * donor_score) if finite_number(donor_score) else None
    return sorted(out, key=lambda stretch: stretch[0])  # stable: ties stay in trial, round order


def _by_trial(storage: Storage, folder: str, last: int | None) -> dict[str, dict[int, dict[str, Any]]]:
    """The records `<trial>-<round>.json` of a folder of PBT's, by trial and round, up to
    round `last` (all when None)."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for name in storage.listdir(f"{PBT_DIR}/{folder}"):
        trial, _, rest = name.rpartition("-")
        if not (trial and rest.endswith(".json") and rest[:-5].isdigit()):
            continue
        n = int(rest[:-5])
        record = read_record(storage, f"{PBT_DIR}/{folder}/{name}") if last is None or n <= last else None
        if record is not None:
            out.setdefault(trial, {})[n] = record
    return out
