"""Ray Tune's `ConcurrencyLimiter`: a search algorithm that runs at most `max_concurrent` of
its trials at once.

It proposes what the searcher it wraps proposes, and is that searcher as far as the sweep's
identity goes (its `describe`), so a restore may change the limit, as it may change
`TuneConfig(max_concurrent_trials)`. The sweep runs min(max_concurrent, max_concurrent_trials,
what the machine holds) trials at once. `batch=True` (Ray: wait until the whole batch has
ended before proposing the next one) is accepted; trials here are proposed one at a time as
slots free up either way, so a batch is the limit itself.
"""

from __future__ import annotations

from typing import Any

from unbroken.store.storage import Storage
from unbroken.store.sweep_manifest import TrialRecord
from unbroken.tune.search.searcher import SearchContext, Searcher


class ConcurrencyLimiter(Searcher):
    """`searcher`, with at most `max_concurrent` of its trials running at once."""

    def __init__(self, searcher: Searcher, max_concurrent: int, batch: bool = False) -> None:
        if not isinstance(searcher, Searcher):
            raise TypeError(f"ConcurrencyLimiter wraps a searcher from unbroken.tune.search, got "
                            f"{type(searcher).__name__}")
        if isinstance(max_concurrent, bool) or not isinstance(max_concurrent, int) or max_concurrent < 1:
            raise ValueError(f"ConcurrencyLimiter max_concurrent must be an int >= 1, got {max_concurrent!r}")
        self.searcher, self.max_concurrent, self.batch = searcher, max_concurrent, batch

    @property
    def upfront(self) -> bool:  # type: ignore[override]
        return self.searcher.upfront

    @property
    def metric(self) -> str | None:
        return getattr(self.searcher, "metric", None)

    @property
    def mode(self) -> str | None:
        return getattr(self.searcher, "mode", None)

    def describe(self) -> dict[str, Any]:
        return self.searcher.describe()

    def check(self, storage: Storage, metric: str | None, mode: str | None) -> None:
        self.searcher.check(storage, metric, mode)

    def total(self, space: dict[str, Any], num_samples: int) -> int:
        return self.searcher.total(space, num_samples)

    def open(self, ctx: SearchContext, records: list[TrialRecord]) -> list[tuple[dict[str, Any], Any]]:
        return self.searcher.open(ctx, records)

    def propose(self, ctx: SearchContext, index: int) -> tuple[dict[str, Any], Any]:
        return self.searcher.propose(ctx, index)

    def on_trial_complete(self, ctx: SearchContext, record: TrialRecord, metrics: dict[str, Any] | None,
                          error: bool) -> None:
        self.searcher.on_trial_complete(ctx, record, metrics, error)

    def close(self) -> None:
        self.searcher.close()
