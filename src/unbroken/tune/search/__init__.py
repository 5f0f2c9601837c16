"""Search algorithms for `TuneConfig(search_alg=...)` (Ray Tune's names).

- `BasicVariantGenerator(random_state=None)`: random and grid search (the default).
- `OptunaSearch(metric=None, mode=None, sampler=None, study_name=None)`: an Optuna study
  kept as a journal inside the sweep directory (needs `pip install 'unbroken[tune]'`; optuna
  is imported only when a sweep uses it). Also importable as
  `unbroken.tune.search.optuna.OptunaSearch`, as in Ray.
- `ConcurrencyLimiter(searcher, max_concurrent)`: at most that many of its trials at once.
"""

from typing import Any

from unbroken.core import ray_names as _ray_names
from unbroken.tune.search.basic_variant import BasicVariantGenerator
from unbroken.tune.search.concurrency_limiter import ConcurrencyLimiter
from unbroken.tune.search.optuna import OptunaSearch
from unbroken.tune.search.searcher import Searcher

__all__ = ["BasicVariantGenerator", "ConcurrencyLimiter", "OptunaSearch", "Searcher"]


def __getattr__(name: str) -> Any:
    _ray_names.refuse(__name__, name)  # a Ray Tune name unbroken does not provide: says what instead
