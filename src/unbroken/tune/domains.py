"""Sampling domains, Ray Tune's search-space functions (`uniform`, `loguniform`, `randint`,
`choice`, `sample_from`, ...) and `grid_search`: what a param_space's leaves may be.

Each domain stores one draw as JSON (a number, the index of a choice) so that the sweep
manifest records a trial by its stored values; `search_space` walks a param_space and
turns stored values back into a config. Domains are dataclasses of importable classes, so a
param_space of plain values and domains is saved as JSON with the sweep.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from unbroken.core.codec import describe
from unbroken.errors import SearchSpaceError


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


def bad_space(message: str) -> SearchSpaceError:
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
            raise bad_space(f"bounds must be finite numbers, got lower={self.lower!r}, upper={self.upper!r}")
        if not self.lower < self.upper:
            raise bad_space(f"lower must be below upper, got lower={self.lower!r}, upper={self.upper!r}. "
                       "Hint: uniform(lower, upper)")
        if self.log and self.lower <= 0:
            raise bad_space(f"a log-uniform domain needs lower > 0, got {self.lower!r}")
        if self.q is not None and not self.q > 0:
            raise bad_space(f"q must be > 0, got {self.q!r}")

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
            raise bad_space(f"bounds must be ints, got lower={self.lower!r}, upper={self.upper!r}")
        if not self.lower < self.upper:
            raise bad_space(f"lower must be below upper, got lower={self.lower!r}, upper={self.upper!r}. "
                       "Hint: randint(lower, upper) samples lower <= x < upper")
        if self.log and self.lower <= 0:
            raise bad_space(f"a log-uniform int domain needs lower > 0, got {self.lower!r}")
        if not (isinstance(self.q, int) and self.q >= 1):
            raise bad_space(f"q must be an int >= 1, got {self.q!r}")

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
    """A float drawn from a normal distribution (`randn`), optionally rounded to `q` (`qrandn`)."""

    mean: float = 0.0
    sd: float = 1.0
    q: float | None = None

    kind = "normal"

    def __post_init__(self) -> None:
        if not self.sd > 0:
            raise bad_space(f"randn needs sd > 0, got {self.sd!r}")
        if self.q is not None and not self.q > 0:
            raise bad_space(f"q must be > 0, got {self.q!r}")

    def sample(self, rng: random.Random) -> float:
        v = rng.gauss(self.mean, self.sd)
        return float(round(v / self.q) * self.q) if self.q is not None else v

    def spec(self) -> dict[str, Any]:
        out = super().spec()
        if self.q is None:
            del out["q"]  # as sweeps saved before qrandn describe randn
        return out

    def value(self, stored: Any) -> float:
        return float(stored)


@dataclass(eq=True)
class Categorical(Domain):
    """One of `categories`, uniformly (`choice`). Stored as the index of the chosen one."""

    categories: list

    kind = "choice"

    def __post_init__(self) -> None:
        if isinstance(self.categories, (str, bytes, dict)) or not hasattr(self.categories, "__len__"):
            raise bad_space(f"choice needs a list of values, got {self.categories!r}")
        self.categories = list(self.categories)
        if not self.categories:
            raise bad_space("choice needs at least one value, got an empty list")

    def sample(self, rng: random.Random) -> int:
        return rng.randrange(len(self.categories))

    def value(self, stored: Any) -> Any:
        return self.categories[int(stored)]


class Spec(dict):
    """What a `sample_from` function is given, as Ray gives it: `spec.config.x` or
    `spec["config"]["x"]`, the trial's config with the values drawn so far."""

    def __getattr__(self, name: str) -> Any:
        try:
            value = self[name]
        except KeyError:
            raise AttributeError(name) from None
        return Spec(value) if isinstance(value, dict) else value


@dataclass(eq=True)
class SampleFrom(Domain):
    """A value computed by `func(spec)` (`sample_from`), once the trial's other values are
    drawn; its result is stored, so it must be JSON (numbers, strings, lists, dicts).

    The function is called with Python's and numpy's global generators seeded from the
    trial's own, so `lambda _: np.random.uniform()` draws reproducibly too; their states are
    put back after the call."""

    func: Callable[[Any], Any]

    kind = "sample_from"

    def __post_init__(self) -> None:
        if not callable(self.func):
            raise bad_space(f"sample_from needs a function of the trial's spec, got {self.func!r}")

    def sample(self, rng: random.Random) -> Any:
        raise bad_space("sample_from is drawn with the trial's other values (search_space.sample)")

    def draw(self, rng: random.Random, config: dict[str, Any]) -> Any:
        """Call the function on `config` (the values drawn so far) and check what it returned."""
        seed = rng.getrandbits(32)
        state, np_state, np = random.getstate(), None, _numpy()
        random.seed(seed)
        if np is not None:
            np_state = np.random.get_state()
            np.random.seed(seed)
        try:
            value = self.func(Spec(config=config))
        finally:
            random.setstate(state)
            if np is not None:
                np.random.set_state(np_state)
        value = value.item() if hasattr(value, "item") and callable(value.item) else value
        try:
            stored = json.loads(json.dumps(value))
        except (TypeError, ValueError):
            stored = None
        if stored != value:
            raise bad_space(f"sample_from({self._name()}) returned {value!r}, which a sweep cannot record. "
                       "Hint: return a number, a string, or lists and dicts of them")
        return stored

    def _name(self) -> str:
        return getattr(self.func, "__qualname__", type(self.func).__qualname__)

    def spec(self) -> dict[str, Any]:
        return {"__domain__": self.kind, "func": f"{getattr(self.func, '__module__', '')}.{self._name()}"}


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # numpy comes with torch; a sweep without it seeds Python's generator only
        return None
    return numpy


@dataclass(eq=True)
class GridSearch:
    """Every one of `values`, each in its own trial (`grid_search`). Stored as an index."""

    values: list

    kind = "grid_search"

    def __post_init__(self) -> None:
        if isinstance(self.values, (str, bytes, dict)) or not hasattr(self.values, "__len__"):
            raise bad_space(f"grid_search needs a list of values, got {self.values!r}")
        self.values = list(self.values)
        if not self.values:
            raise bad_space("grid_search needs at least one value, got an empty list")

    def value(self, stored: Any) -> Any:
        return self.values[int(stored)]

    def spec(self) -> dict[str, Any]:
        return {"grid_search": describe(self.values)}


# -- the public constructors (Ray Tune's names) ---------------------------------------------
def uniform(lower: float, upper: float) -> Float:
    return Float(lower, upper)


def quniform(lower: float, upper: float, q: float) -> Float:
    return Float(lower, upper, q=q)


def loguniform(lower: float, upper: float, base: float = 10) -> Float:
    """Log-uniform in [lower, upper] (the distribution does not depend on `base`)."""
    return Float(lower, upper, log=True)


def qloguniform(lower: float, upper: float, q: float, base: float = 10) -> Float:
    return Float(lower, upper, log=True, q=q)


def randint(lower: int, upper: int) -> Integer:
    """An int with lower <= x < upper."""
    return Integer(lower, upper)


def qrandint(lower: int, upper: int, q: int = 1) -> Integer:
    """An int with lower <= x <= upper, rounded to a multiple of q."""
    return Integer(lower, upper, q=q, upper_inclusive=True)


def lograndint(lower: int, upper: int, base: float = 10) -> Integer:
    """An int with lower <= x < upper, log-uniform."""
    return Integer(lower, upper, log=True)


def qlograndint(lower: int, upper: int, q: int, base: float = 10) -> Integer:
    """An int with lower <= x <= upper, log-uniform, rounded to a multiple of q."""
    return Integer(lower, upper, log=True, q=q, upper_inclusive=True)


def randn(mean: float = 0.0, sd: float = 1.0) -> Normal:
    return Normal(mean, sd)


def qrandn(mean: float, sd: float, q: float) -> Normal:
    """A normal draw rounded to a multiple of q."""
    return Normal(mean, sd, q=q)


def sample_from(func: Callable[[Any], Any]) -> SampleFrom:
    """A value computed from the trial's spec: `sample_from(lambda spec: spec.config.a * 2)`."""
    return SampleFrom(func)


def choice(categories: list) -> Categorical:
    return Categorical(categories)


def grid_search(values: list) -> GridSearch:
    return GridSearch(values)
