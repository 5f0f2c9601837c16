"""The interface of a search algorithm, as the sweep driver uses it.

A searcher proposes the stored values of new trials (see `search_space`) and learns from
finished ones. Whatever state it needs to propose after a restore exactly what it would
have proposed without one lives in the sweep directory: the basic generator needs only the
seed in the sweep manifest; Optuna keeps its study there as a journal (`optuna_journal`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from unbroken.store.storage import Storage
from unbroken.store.sweep_manifest import TrialRecord


@dataclass
class SearchContext:
    """What a searcher gets from the sweep it works for."""

    storage: Storage        # the sweep root
    name: str               # the sweep name
    space: dict[str, Any]   # the param_space
    seed: int
    metric: str | None
    mode: str | None
    num_samples: int


def derive_seed(seed: int, index: int) -> int:
    """A 32-bit seed for proposal `index` of a sweep seeded with `seed`."""
    return int(hashlib.sha256(f"{seed}:{index}".encode()).hexdigest()[:8], 16)


class Searcher:
    """Base class of the search algorithms in `unbroken.tune.search`."""

    #: True when every trial can be proposed when the sweep starts (no feedback needed).
    upfront = False
    #: At most this many of its trials run at once (None: no limit of its own).
    max_concurrent: int | None = None

    def describe(self) -> dict[str, Any]:
        """JSON: what makes this searcher propose what it proposes (part of the sweep's identity)."""
        return {"kind": type(self).__name__}

    def check(self, storage: Storage, metric: str | None, mode: str | None) -> None:
        """Refuse, before the sweep writes anything, a sweep this searcher cannot serve."""

    def total(self, space: dict[str, Any], num_samples: int) -> int:
        """How many trials the sweep has."""
        return num_samples

    def open(self, ctx: SearchContext, records: list[TrialRecord]) -> list[tuple[dict[str, Any], Any]]:
        """Attach to the sweep (called by the driver holding the sweep's lease). Returns
        proposals that were made but never recorded in the manifest (the driver died in
        between), as (values, searcher_id), to be adopted as the next trials."""
        return []

    def propose(self, ctx: SearchContext, index: int) -> tuple[dict[str, Any], Any]:
        """The stored values of trial `index` and the searcher's id for it."""
        raise NotImplementedError

    def on_trial_complete(self, ctx: SearchContext, record: TrialRecord, metrics: dict[str, Any] | None,
                          error: bool) -> None:
        """A trial finished (TERMINATED) or failed (ERROR); `metrics` is its last row. Must be
        idempotent: after a crash it may be called again for the same outcome."""

    def close(self) -> None:
        """Release what open() acquired."""
