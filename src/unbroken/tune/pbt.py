"""Population-based training: the scheduler's settings (Ray Tune's names) and its two pure
decisions, which trials are weak enough to exploit a strong one (`quantiles`) and how an
exploiting trial's hyperparameters change (`explore`). Where the decisions are made, recorded
and applied is `population`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from unbroken.core.codec import qualified_name
from unbroken.tune import search_space as ss


@dataclass
class PopulationBasedTraining:
    """Every `perturbation_interval` of `time_attr` (after `burn_in_period`), a trial in the
    bottom `quantile_fraction` of the population by `metric` takes over the latest checkpoint
    of a trial in the top one (exploit) and changes the hyperparameters of
    `hyperparam_mutations` (explore): each one is drawn again with `resample_probability`,
    else moved (a number times one of `perturbation_factors`, a list's neighbour). With
    `synch=True` the decisions wait until every trial reached the point. `custom_explore_fn`
    takes the new config and returns the one to use. Trials must report a checkpoint at (or
    after) each point: a trial pauses at the first row past the point that carries one.
    """

    time_attr: str = "training_iteration"
    metric: str | None = None
    mode: str | None = None
    perturbation_interval: float = 60.0
    burn_in_period: float = 0.0
    hyperparam_mutations: dict[str, Any] = field(default_factory=dict)
    quantile_fraction: float = 0.25
    resample_probability: float = 0.25
    perturbation_factors: tuple[float, float] = (1.2, 0.8)
    custom_explore_fn: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    synch: bool = False
    require_attrs: bool = True
    log_config: bool = True

    def __post_init__(self) -> None:
        self._check_settings()
        if not 0 <= self.resample_probability <= 1:
            raise ValueError("PopulationBasedTraining resample_probability must be between 0 and 1, got "
                             f"{self.resample_probability!r}")
        if not self.hyperparam_mutations and self.custom_explore_fn is None:
            raise ValueError("PopulationBasedTraining needs hyperparam_mutations or custom_explore_fn. Hint: "
                             "hyperparam_mutations={'lr': tune.loguniform(1e-4, 1e-1)}")
        for path, spec in leaves(self.hyperparam_mutations):
            if not (isinstance(spec, (list, ss.Float, ss.Integer, ss.Categorical)) or callable(spec)):
                raise ValueError(f"PopulationBasedTraining hyperparam_mutations[{path!r}] must be a list, a "
                                 f"search domain (tune.uniform, ...) or a function, got {spec!r}")

    def _check_settings(self) -> None:
        """The settings PB2 shares (it checks its bounds itself): ValueError on a bad one."""
        kind = type(self).__name__
        if self.mode not in (None, "min", "max"):
            raise ValueError(f"{kind} mode must be 'min' or 'max', got {self.mode!r}")
        if not self.perturbation_interval > 0:
            raise ValueError(f"{kind} perturbation_interval must be > 0, got {self.perturbation_interval!r}")
        if not 0 <= self.quantile_fraction <= 0.5:
            raise ValueError(f"{kind} quantile_fraction must be between 0 and 0.5, got "
                             f"{self.quantile_fraction!r}")

    def check_space(self, param_space: dict[str, Any]) -> None:
        """Refuse a sweep's `param_space` the explore step cannot work on, before any trial is
        proposed. Nothing here; PB2 needs a starting value at each bound's key."""

    def check_config(self, config: dict[str, Any]) -> None:
        """Refuse a trial's sampled `config` the explore step cannot work on, before the trial
        runs. Nothing to refuse here: a mutation may add a key; PB2 checks its bounds' keys."""

    def new_config(self, exploit: Exploit, rng: random.Random) -> dict[str, Any]:
        """The config an exploiting trial continues with: the donor's, explored (`explore`).
        The one step PB2 changes; `rng` is the decision's seeded generator, so the same
        records give the same config after a restore."""
        return explore(exploit.donor_config, self, rng)

    def describe(self) -> dict[str, Any]:
        mutations = {path: (spec.spec() if isinstance(spec, ss.Domain) else
                            qualified_name(spec) if callable(spec) else spec)
                     for path, spec in leaves(self.hyperparam_mutations)}
        explore = qualified_name(self.custom_explore_fn) if self.custom_explore_fn else None
        return {"kind": "pbt", "time_attr": self.time_attr, "metric": self.metric, "mode": self.mode,
                "perturbation_interval": self.perturbation_interval, "burn_in_period": self.burn_in_period,
                "hyperparam_mutations": mutations, "quantile_fraction": self.quantile_fraction,
                "resample_probability": self.resample_probability,
                "perturbation_factors": list(self.perturbation_factors), "custom_explore_fn": explore,
                "synch": self.synch}

    def first_point(self) -> float:
        """The first perturbation point: one interval in, and not before the burn-in ends."""
        return max(self.perturbation_interval, self.burn_in_period)


@dataclass(frozen=True)
class Exploit:
    """One exploit being decided (see `population`): `trial` takes over `donor`'s checkpoint at
    its round `round`; `at` is the round whose scores decided it (None without `synch`: the
    latest ones); the donor's config and the pause whose checkpoint is taken; and the
    `population.Population` it is decided in, whose records a learning scheduler reads."""

    trial: str
    donor: str
    round: int
    at: int | None
    donor_config: dict[str, Any]
    donor_pause: dict[str, Any]
    population: Any


def quantiles(scores: dict[str, float], fraction: float, mode: str) -> tuple[list[str], list[str]]:
    """(the bottom trials, the top trials) of `scores` by name, `fraction` of them each (at
    most half), worst first / best last, as Ray's PBT ranks them; ties by name."""
    ranked = sorted(scores, key=lambda name: (scores[name] if mode == "max" else -scores[name], name))
    if len(ranked) <= 1:
        return [], []
    count = math.ceil(len(ranked) * fraction)
    count = min(count, len(ranked) // 2)
    return ranked[:count], ranked[len(ranked) - count:]


def explore(config: dict[str, Any], scheduler: PopulationBasedTraining, rng: random.Random) -> dict[str, Any]:
    """`config` with the hyperparameters of `scheduler.hyperparam_mutations` changed (see
    PopulationBasedTraining), then through `custom_explore_fn` if given."""
    out = _copy(config)
    for path, spec in leaves(scheduler.hyperparam_mutations):
        old = value_at(config, path)
        _set(out, path, _mutate(old, spec, scheduler, rng))
    if scheduler.custom_explore_fn is not None:
        out = scheduler.custom_explore_fn(out)
    return out


def _mutate(old: Any, spec: Any, scheduler: PopulationBasedTraining, rng: random.Random) -> Any:
    resample = rng.random() < scheduler.resample_probability
    if isinstance(spec, list):
        if resample or old not in spec:
            return rng.choice(spec)
        i = spec.index(old) + rng.choice([-1, 1])
        return spec[min(max(i, 0), len(spec) - 1)]
    if isinstance(spec, ss.Domain):
        if resample or not isinstance(old, (int, float)) or isinstance(spec, ss.Categorical):
            return spec.value(spec.sample(rng))
        new = old * rng.choice(list(scheduler.perturbation_factors))
        return int(round(new)) if isinstance(spec, ss.Integer) else new
    if resample or not isinstance(old, (int, float)):
        return spec()
    return old * rng.choice(list(scheduler.perturbation_factors))


def differences(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The values of `new` that differ from `old`, by path (nested dicts flattened)."""
    flat_old = dict(leaves(old))
    return {path: value for path, value in leaves(new) if flat_old.get(path, _MISSING) != value}


def apply(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`config` with `overrides` (values by path) set."""
    out = _copy(config)
    for path, value in overrides.items():
        _set(out, path, value)
    return out


_MISSING = object()


def leaves(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """(path, value) of each value of `tree` that is not a dict, nested dicts flattened (paths
    as in `differences`)."""
    out = []
    for key, value in (tree or {}).items():
        path = f"{prefix}{ss.SEP}{key}" if prefix else str(key)
        if isinstance(value, dict):
            out.extend(leaves(value, path))
        else:
            out.append((path, value))
    return out


def value_at(tree: dict[str, Any], path: str) -> Any:
    """The value at `path` in `tree`, or None when there is none."""
    node: Any = tree
    for part in path.split(ss.SEP):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set(tree: dict[str, Any], path: str, value: Any) -> None:
    parts = path.split(ss.SEP)
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def _copy(tree: Any) -> Any:
    return {k: _copy(v) for k, v in tree.items()} if isinstance(tree, dict) else tree
