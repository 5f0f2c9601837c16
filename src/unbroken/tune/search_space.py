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

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Any

from unbroken.core.codec import describe
from unbroken.errors import SearchSpaceError

SEP = "/"
# Search-space objects of other libraries, refused with a hint rather than passed on as constants.
_FOREIGN = ("ray.tune", "optuna.distributions", "hyperopt", "skopt", "nevergrad")


class Domain:
    """A distribution one value of a trial's config is sampled from."""

    kind = "domain"

    def sample(self, rng: random.Random) -> Any:
        """The stored value (JSON) of one draw."""
        raise NotImplementedError

    def value(self, stored: Any) -> Any:
        """The config value for a stored value."""
        return stored

    def spec(self) -> dict[str, Any]:
        """A JSON description: what makes this domain this domain (identity, display)."""
        out: dict[str, Any] = {"__domain__": self.kind}
        out.update({f.name: describe(getattr(self, f.name)) for f in dataclasses.fields(self)})
        return out


def _bad(message: str) -> SearchSpaceError:
    return SearchSpaceError(message)


@dataclass(eq=True)
class Float(Domain):
    """A float between `lower` and `upper`, uniform or log-uniform, optionally rounded to `q`."""

    lower: float
    upper: float
    log: bool = False
    q: float | None = None

    kind = "float"

    def __post_init__(self) -> None:
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (self.lower, self.upper)):
            raise _bad(f"bounds must be finite numbers, got lower={self.lower!r}, upper={self.upper!r}")
        if not self.lower < self.upper:
            raise _bad(f"lower must be below upper, got lower={self.lower!r}, upper={self.upper!r}. "
                       "Hint: uniform(lower, upper)")
        if self.log and self.lower <= 0:
            raise _bad(f"a log-uniform domain needs lower > 0, got {self.lower!r}")
        if self.q is not None and not self.q > 0:
            raise _bad(f"q must be > 0, got {self.q!r}")

    def sample(self, rng: random.Random) -> float:
        if self.log:
            v = math.exp(rng.uniform(math.log(self.lower), math.log(self.upper)))
        else:
            v = rng.uniform(self.lower, self.upper)
        if self.q is not None:
            v = round(v / self.q) * self.q
        return float(v)

    def value(self, stored: Any) -> float:
        return float(stored)


@dataclass(eq=True)
class Integer(Domain):
    """An int in [lower, upper) (`randint`, `lograndint`) or [lower, upper] (`qrandint`)."""

    lower: int
    upper: int
    log: bool = False
    q: int = 1
    upper_inclusive: bool = False

    kind = "int"

    def __post_init__(self) -> None:
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (self.lower, self.upper)):
            raise _bad(f"bounds must be ints, got lower={self.lower!r}, upper={self.upper!r}")
        if not self.lower < self.upper:
            raise _bad(f"lower must be below upper, got lower={self.lower!r}, upper={self.upper!r}. "
                       "Hint: randint(lower, upper) samples lower <= x < upper")
        if self.log and self.lower <= 0:
            raise _bad(f"a log-uniform int domain needs lower > 0, got {self.lower!r}")
        if not (isinstance(self.q, int) and self.q >= 1):
            raise _bad(f"q must be an int >= 1, got {self.q!r}")

    @property
    def high(self) -> int:
        """The largest value that can be drawn."""
        return self.upper if self.upper_inclusive else self.upper - 1

    def sample(self, rng: random.Random) -> int:
        if self.log:
            v = int(math.exp(rng.uniform(math.log(self.lower), math.log(self.high + 1))))
            v = min(max(v, self.lower), self.high)
        else:
            v = rng.randint(self.lower, self.high)
        if self.q > 1:
            v = min(max(int(round(v / self.q)) * self.q, self.lower), self.high)
        return v

    def value(self, stored: Any) -> int:
        return int(stored)


@dataclass(eq=True)
class Normal(Domain):
    """A float drawn from a normal distribution (`randn`)."""

    mean: float = 0.0
    sd: float = 1.0

    kind = "normal"

    def __post_init__(self) -> None:
        if not self.sd > 0:
            raise _bad(f"randn needs sd > 0, got {self.sd!r}")

    def sample(self, rng: random.Random) -> float:
        return rng.gauss(self.mean, self.sd)

    def value(self, stored: Any) -> float:
        return float(stored)


@dataclass(eq=True)
class Categorical(Domain):
    """One of `categories`, uniformly (`choice`). Stored as the index of the chosen one."""

    categories: list

    kind = "choice"

    def __post_init__(self) -> None:
        if isinstance(self.categories, (str, bytes, dict)) or not hasattr(self.categories, "__len__"):
            raise _bad(f"choice needs a list of values, got {self.categories!r}")
        self.categories = list(self.categories)
        if not self.categories:
            raise _bad("choice needs at least one value, got an empty list")

    def sample(self, rng: random.Random) -> int:
        return rng.randrange(len(self.categories))

    def value(self, stored: Any) -> Any:
        return self.categories[int(stored)]


@dataclass(eq=True)
class GridSearch:
    """Every one of `values`, each in its own trial (`grid_search`). Stored as an index."""

    values: list

    kind = "grid_search"

    def __post_init__(self) -> None:
        if isinstance(self.values, (str, bytes, dict)) or not hasattr(self.values, "__len__"):
            raise _bad(f"grid_search needs a list of values, got {self.values!r}")
        self.values = list(self.values)
        if not self.values:
            raise _bad("grid_search needs at least one value, got an empty list")

    def value(self, stored: Any) -> Any:
        return self.values[int(stored)]

    def spec(self) -> dict[str, Any]:
        return {"grid_search": describe(self.values)}


# -- the public constructors (Ray Tune's names) ---------------------------------------------
def uniform(lower: float, upper: float) -> Float:
    return Float(lower, upper)


def quniform(lower: float, upper: float, q: float) -> Float:
    return Float(lower, upper, q=q)


def loguniform(lower: float, upper: float) -> Float:
    return Float(lower, upper, log=True)


def qloguniform(lower: float, upper: float, q: float) -> Float:
    return Float(lower, upper, log=True, q=q)


def randint(lower: int, upper: int) -> Integer:
    """An int with lower <= x < upper."""
    return Integer(lower, upper)


def qrandint(lower: int, upper: int, q: int = 1) -> Integer:
    """An int with lower <= x <= upper, rounded to a multiple of q."""
    return Integer(lower, upper, q=q, upper_inclusive=True)


def lograndint(lower: int, upper: int) -> Integer:
    """An int with lower <= x < upper, log-uniform."""
    return Integer(lower, upper, log=True)


def randn(mean: float = 0.0, sd: float = 1.0) -> Normal:
    return Normal(mean, sd)


def choice(categories: list) -> Categorical:
    return Categorical(categories)


def grid_search(values: list) -> GridSearch:
    return GridSearch(values)


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
        raise _bad(f"param_space[{where!r}] is a {module}.{type(value).__qualname__}, which unbroken "
                   "cannot sample. Hint: use unbroken.tune's uniform, loguniform, randint, choice or "
                   "grid_search")
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            if isinstance(item, (Domain, GridSearch)):
                raise _bad(f"param_space[{where!r}] has a search-space value inside a list (item {i}); "
                           "only dict values are sampled. Hint: use a dict, or choice([...]) of "
                           "whole lists")
            _check_constant(item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, (Domain, GridSearch)) or _as_grid(v) is not None:
                raise _bad(f"param_space[{where!r}] has a search-space value under the non-string key "
                           f"{k!r}. Hint: use string keys")
            _check_constant(v, f"{where}.{k}")


def leaves(space: dict[str, Any]) -> list[tuple[str, Leaf]]:
    """The domains and grid searches of `space`, by path, sorted by path: the order in which
    values are drawn does not depend on the order the dict was written in."""
    if not isinstance(space, dict):
        raise _bad(f"param_space must be a dict, got {type(space).__name__}")
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
        raise _bad(f"param_space has two search-space values at the same path ({names}); keys must not "
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
        else:
            values[path] = leaf.sample(rng)
    return values


def resolve(space: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """The trial config: `space` with each domain and grid replaced by its stored value."""

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
                if path not in values:
                    raise _bad(f"no recorded value for {path!r}; the param_space does not match the sweep's")
                out[key] = leaf.value(values[path])
            elif isinstance(value, dict):
                out[key] = walk(value, prefix + (key,))
            else:
                out[key] = value
        return out

    return walk(space, ())


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
