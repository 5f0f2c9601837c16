"""The search space: sampling domains (`uniform`, `loguniform`, `randint`, `choice`, ...),
`grid_search`, and how a `param_space` becomes one trial's config.

A param_space is a dict, possibly nested, whose leaves are constants, domains or grid
searches. A trial is described by the *stored values* of its leaves (a number for numeric
domains, an index for `choice` and `grid_search`), keyed by the leaf's path ("a/b"). The
sweep manifest records these, and `resolve(space, values)` rebuilds the config from the
param_space given now, so constants (datasets, objects) can be re-specified on restore.

Domains are dataclasses of importable classes, so a param_space of plain values and domains
is saved as JSON with the sweep.
"""

from __future__ import annotations

import math
import random
from typing import Any

from unbroken.core.codec import describe
from unbroken.tune.domains import (  # noqa: F401 - the leaves' classes, re-exported
    Categorical,
    Domain,
    Float,
    GridSearch,
    Integer,
    Normal,
    SampleFrom,
    bad_space,
)

SEP = "/"
# Search-space objects of other libraries, refused with a hint rather than passed on as constants.
_FOREIGN = ("ray.tune", "optuna.distributions", "hyperopt", "skopt", "nevergrad")


# -- walking a param_space ------------------------------------------------------------------
Leaf = Domain | GridSearch


def _as_grid(value: Any) -> GridSearch | None:
    if isinstance(value, GridSearch):
        return value
    if isinstance(value, dict) and set(value) == {"grid_search"}:  # Ray's literal form
        return GridSearch(value["grid_search"])
    return None


def _check_constant(value: Any, where: str) -> None:
    """Refuse search-space objects in places they would be passed on unsampled."""
    module = type(value).__module__ or ""
    if module.startswith(_FOREIGN):
        raise bad_space(f"param_space[{where!r}] is a {module}.{type(value).__qualname__}, which unbroken "
                   "cannot sample. Hint: use unbroken.tune's uniform, loguniform, randint, choice or "
                   "grid_search")
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            if isinstance(item, (Domain, GridSearch)):
                raise bad_space(f"param_space[{where!r}] has a search-space value inside a list (item {i}); "
                           "only dict values are sampled. Hint: use a dict, or choice([...]) of "
                           "whole lists")
            _check_constant(item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, (Domain, GridSearch)) or _as_grid(v) is not None:
                raise bad_space(f"param_space[{where!r}] has a search-space value under the non-string key "
                           f"{k!r}. Hint: use string keys")
            _check_constant(v, f"{where}.{k}")


def leaves(space: dict[str, Any]) -> list[tuple[str, Leaf]]:
    """The domains and grid searches of `space`, by path, sorted by path: the order in which
    values are drawn does not depend on the order the dict was written in."""
    if not isinstance(space, dict):
        raise bad_space(f"param_space must be a dict, got {type(space).__name__}")
    out: list[tuple[str, Leaf]] = []

    def walk(node: dict, prefix: tuple[str, ...]) -> None:
        for key, value in node.items():
            if not isinstance(key, str):
                _check_constant(value, SEP.join(prefix + (repr(key),)))
                continue
            path = prefix + (key,)
            grid = _as_grid(value)
            if grid is not None:
                out.append((SEP.join(path), grid))
            elif isinstance(value, Domain):
                out.append((SEP.join(path), value))
            elif isinstance(value, dict):
                walk(value, path)
            else:
                _check_constant(value, SEP.join(path))

    walk(space, ())
    names = [p for p, _ in out]
    if len(set(names)) != len(names):
        raise bad_space(f"param_space has two search-space values at the same path ({names}); keys must not "
                   f"contain {SEP!r}")
    return sorted(out, key=lambda item: item[0])


def grid_size(space: dict[str, Any]) -> int:
    return math.prod(len(leaf.values) for _, leaf in leaves(space) if isinstance(leaf, GridSearch))


def sample(space: dict[str, Any], seed: int, index: int, num_grid: int | None = None) -> dict[str, Any]:
    """The stored values of trial `index`: its grid point (index modulo the grid size, the
    grid key that sorts first varying fastest) and random draws from a generator seeded by (seed, index),
    so a trial's config never depends on which trials were proposed before it."""
    items = leaves(space)
    rng = random.Random(f"unbroken-tune:{seed}:{index}")
    grid_index = index % (num_grid or grid_size(space))
    values: dict[str, Any] = {}
    for path, leaf in items:
        if isinstance(leaf, GridSearch):
            grid_index, values[path] = divmod(grid_index, len(leaf.values))
        elif not isinstance(leaf, SampleFrom):
            values[path] = leaf.sample(rng)
    for path, leaf in items:  # last, in path order: each sees the values drawn before it
        if isinstance(leaf, SampleFrom):
            values[path] = leaf.draw(rng, resolve(space, values, drawing=True))
    return values


def resolve(space: dict[str, Any], values: dict[str, Any], drawing: bool = False) -> dict[str, Any]:
    """The trial config: `space` with each domain and grid replaced by its stored value
    (`drawing`: a `sample_from` not drawn yet is left as it is). A stored value at a path that
    is no leaf of `space` is a value a searcher chose itself (Optuna's define-by-run): it is
    set at that path."""

    def walk(node: dict, prefix: tuple[str, ...]) -> dict:
        out = {}
        for key, value in node.items():
            if not isinstance(key, str):
                out[key] = value
                continue
            path = SEP.join(prefix + (key,))
            grid = _as_grid(value)
            if grid is not None or isinstance(value, Domain):
                leaf = grid if grid is not None else value
                if path not in values and drawing and isinstance(leaf, SampleFrom):
                    out[key] = leaf
                    continue
                if path not in values:
                    raise bad_space(f"no recorded value for {path!r}; the param_space does not match "
                                    "the sweep's")
                out[key] = leaf.value(values[path])
            elif isinstance(value, dict):
                out[key] = walk(value, prefix + (key,))
            else:
                out[key] = value
        return out

    config = walk(space, ())
    own = {p for p, _ in leaves(space)} if values else set()
    for path, value in values.items():
        if path not in own:
            *parents, last = path.split(SEP)
            node = config
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = value
    return config


def spec(space: Any) -> Any:
    """A JSON description of a param_space: domains by their parameters, constants as values
    (objects by type name). Two param_spaces with the same spec propose the same trials."""
    grid = _as_grid(space) if isinstance(space, (dict, GridSearch)) else None
    if grid is not None:
        return grid.spec()
    if isinstance(space, Domain):
        return space.spec()
    if isinstance(space, dict):
        return {str(k): spec(v) for k, v in space.items()}
    return describe(space)


def shape(space: dict[str, Any]) -> dict[str, Any]:
    """Every key path of a param_space with its domain spec, or "value" for a constant:
    what Tuner.restore(param_space=...) must keep (it may change the constants)."""
    out: dict[str, Any] = {}

    def walk(node: dict, prefix: tuple[str, ...]) -> None:
        for key, value in node.items():
            path = prefix + (str(key),)
            grid = _as_grid(value)
            if grid is not None or isinstance(value, Domain):
                out[SEP.join(path)] = (grid or value).spec()
            elif isinstance(value, dict) and value:
                walk(value, path)
            else:
                out[SEP.join(path)] = "value"

    walk(space, ())
    return out


def flatten_config(config: Any, prefix: str = "") -> dict[str, Any]:
    """A trial config as {"a/b": value} (for the result dataframe's config/ columns)."""
    if isinstance(config, dict) and config:
        out: dict[str, Any] = {}
        for k, v in config.items():
            out.update(flatten_config(v, f"{prefix}{SEP}{k}" if prefix else str(k)))
        return out
    return {prefix: config}
