"""The search space: sampling domains (`uniform`, `loguniform`, `randint`, `choice`, ...),
`grid_search`, and how a `param_space` becomes one trial's config.

A param_space is a dict, possibly nested, whose leaves are constants, domains or grid
searches; as in Ray, domains may also sit inside lists (and tuples), at any depth. A trial is
described by the *stored values* of its leaves (a number for numeric domains, an index for
`choice` and `grid_search`), keyed by the leaf's path: dict keys and list positions joined
by "/", a position written "[i]" ("a/b", "layers/[0]", "blocks/[1]/width"). The
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


def _is_leaf(value: Any) -> bool:
    return isinstance(value, (Domain, GridSearch)) or _as_grid(value) is not None


def _has_leaf(value: Any) -> bool:
    """Whether a list, tuple or dict holds a domain or grid search, at any depth: only such a
    list is walked position by position; any other list stays a constant, described and
    passed on as it always was."""
    if _is_leaf(value):
        return True
    if isinstance(value, dict):
        return any(isinstance(k, str) and _has_leaf(v) for k, v in value.items())
    return isinstance(value, (list, tuple)) and any(_has_leaf(v) for v in value)


def _position(i: int) -> str:
    """A list position as a path component: "[i]", apart from any string key of a dict."""
    return f"[{i}]"


def _check_constant(value: Any, where: str) -> None:
    """Refuse search-space objects in places they would be passed on unsampled: another
    library's anywhere, ours inside what a path cannot name (under a non-string key)."""
    module = type(value).__module__ or ""
    if module.startswith(_FOREIGN):
        raise bad_space(f"param_space[{where!r}] is a {module}.{type(value).__qualname__}, which unbroken "
                   "cannot sample. Hint: use unbroken.tune's uniform, loguniform, randint, choice or "
                   "grid_search")
    items = (list(enumerate(value)) if isinstance(value, (list, tuple)) else
             list(value.items()) if isinstance(value, dict) else [])
    for k, v in items:
        if _is_leaf(v):
            raise bad_space(f"param_space[{where!r}] has a search-space value under a non-string key "
                            f"({k!r} inside it). Hint: use string keys")
        _check_constant(v, f"{where}[{k!r}]")


def leaves(space: dict[str, Any]) -> list[tuple[str, Leaf]]:
    """The domains and grid searches of `space`, by path, sorted by path: the order in which
    values are drawn does not depend on the order the dict was written in. List positions sort
    by number ("[2]" before "[10]"), and paths without one sort as they always did, so a sweep
    saved before lists could hold domains proposes the same trials."""
    if not isinstance(space, dict):
        raise bad_space(f"param_space must be a dict, got {type(space).__name__}")
    out: list[tuple[str, str, Leaf]] = []  # (sort key, path, leaf)

    def visit_dict(node: dict, path: tuple[str, ...], order: tuple[str, ...]) -> None:
        for key, item in node.items():
            if isinstance(key, str):
                visit(item, path + (key,), order + (key,))
            else:
                _check_constant(item, SEP.join(path + (repr(key),)))

    def visit(value: Any, path: tuple[str, ...], order: tuple[str, ...]) -> None:
        grid = _as_grid(value)
        if grid is not None or isinstance(value, Domain):
            out.append((SEP.join(order), SEP.join(path), grid if grid is not None else value))
        elif isinstance(value, dict):
            visit_dict(value, path, order)
        elif isinstance(value, (list, tuple)) and _has_leaf(value):
            for i, item in enumerate(value):
                visit(item, path + (_position(i),), order + (f"[{i:012d}]",))
        else:
            _check_constant(value, SEP.join(path))

    visit_dict(space, (), ())  # the space itself is a dict, even one keyed "grid_search"
    names = [p for _, p, _ in out]
    if len(set(names)) != len(names):
        raise bad_space(f"param_space has two search-space values at the same path ({names}); keys must not "
                   f"contain {SEP!r}")
    return [(path, leaf) for _, path, leaf in sorted(out, key=lambda item: item[0])]


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

    def fill_dict(node: dict, prefix: tuple[str, ...]) -> dict:
        return {key: fill(value, prefix + (key,)) if isinstance(key, str) else value
                for key, value in node.items()}

    def fill(value: Any, path: tuple[str, ...]) -> Any:
        grid = _as_grid(value)
        if grid is not None or isinstance(value, Domain):
            leaf, where = grid if grid is not None else value, SEP.join(path)
            if where not in values and drawing and isinstance(leaf, SampleFrom):
                return leaf
            if where not in values:
                raise bad_space(f"no recorded value for {where!r}; the param_space does not match "
                                "the sweep's")
            return leaf.value(values[where])
        if isinstance(value, dict):
            return fill_dict(value, path)
        if isinstance(value, (list, tuple)) and _has_leaf(value):  # else the very same constant
            items = [fill(item, path + (_position(i),)) for i, item in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return value

    config = fill_dict(space, ())
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
    if isinstance(space, (list, tuple)) and _has_leaf(space):
        return [spec(v) for v in space]  # a list holding domains: position by position
    return describe(space)  # any other list exactly as before lists could hold domains


def shape(space: dict[str, Any]) -> dict[str, Any]:
    """Every key path of a param_space with its domain spec, or "value" for a constant:
    what Tuner.restore(param_space=...) must keep (it may change the constants). A list
    holding domains is walked position by position, so its length and its domains must stay."""
    out: dict[str, Any] = {}

    def visit(value: Any, path: tuple[str, ...]) -> None:
        grid = _as_grid(value)
        if grid is not None or isinstance(value, Domain):
            out[SEP.join(path)] = (grid or value).spec()
        elif isinstance(value, dict) and value:
            for key, item in value.items():
                visit(item, path + (str(key),))
        elif isinstance(value, (list, tuple)) and _has_leaf(value):
            for i, item in enumerate(value):
                visit(item, path + (_position(i),))
        else:
            out[SEP.join(path)] = "value"

    for key, value in space.items():
        visit(value, (str(key),))
    return out


def flatten_config(config: Any, prefix: str = "") -> dict[str, Any]:
    """A trial config as {"a/b": value} (for the result dataframe's config/ columns)."""
    if isinstance(config, dict) and config:
        out: dict[str, Any] = {}
        for k, v in config.items():
            out.update(flatten_config(v, f"{prefix}{SEP}{k}" if prefix else str(k)))
        return out
    return {prefix: config}
