"""Random and grid search (Ray Tune's BasicVariantGenerator)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from unbroken.tune import search_space
from unbroken.tune.search.searcher import SearchContext, Searcher


@dataclass
class BasicVariantGenerator(Searcher):
    """Grid search over `grid_search` values, random draws for the other domains.

    The trial with index i gets grid point i modulo the grid size and random values drawn
    from a generator seeded with (seed, i): proposing is reproducible by construction, so a
    restored or extended sweep proposes what an uninterrupted one would. `random_state`
    overrides `TuneConfig(seed=...)`.
    """

    random_state: int | None = None

    upfront = True

    def describe(self) -> dict[str, Any]:
        return {"kind": "basic_variant"}

    def total(self, space: dict[str, Any], num_samples: int) -> int:
        return num_samples * search_space.grid_size(space)

    def propose(self, ctx: SearchContext, index: int) -> tuple[dict[str, Any], Any]:
        return search_space.sample(ctx.space, ctx.seed, index), None
