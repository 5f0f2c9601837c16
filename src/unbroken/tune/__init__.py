"""unbroken.tune: hyperparameter sweeps whose trials are restorable runs (Ray Tune's API).

Driver side: `Tuner(trainable, param_space=..., tune_config=TuneConfig(...),
run_config=RunConfig(...)).fit() -> ResultGrid`, `Tuner.restore(path, trainable, ...)`,
`Tuner.can_restore(path)`, and the search space: `grid_search`, `choice`, `uniform`,
`quniform`, `loguniform`, `qloguniform`, `randint`, `qrandint`, `lograndint`, `qlograndint`,
`randn`, `qrandn`, `sample_from`; and
what a function trainable is given besides its config: `with_parameters`, `with_resources`;
`Trainable`, Ray Tune's class API; `Callback` (sweep callbacks; `LoggerCallback` is in
`unbroken.tune.logger`); `Stopper` (the stoppers are in `unbroken.tune.stopper`).
Search algorithms are in `unbroken.tune.search`, schedulers in `unbroken.tune.schedulers`.

Worker side (inside the trainable): `report`, `get_checkpoint`, `get_context`, the same
functions as `unbroken.train`'s.

Layer 7 (public API, with its sweep machinery: `tuner`, `saved_sweep`, `sweep_driver`,
`trial`, `asha`, `search/`): may import every layer below, `unbroken.train` included.
"""

from __future__ import annotations

from typing import Any

from unbroken.core import ray_names as _ray_names
from unbroken.train import (
    Checkpoint,
    CheckpointConfig,
    FailureConfig,
    RunConfig,
    get_checkpoint,
    get_context,
    report,
)
from unbroken.tune.callback import Callback
from unbroken.tune.domains import (
    choice,
    grid_search,
    lograndint,
    loguniform,
    qlograndint,
    qloguniform,
    qrandint,
    qrandn,
    quniform,
    randint,
    randn,
    sample_from,
    uniform,
)
from unbroken.tune.function_trainable import with_parameters, with_resources
from unbroken.tune.result_grid import ResultGrid, TrialResult
from unbroken.tune.stopper import Stopper
from unbroken.tune.trainable import Trainable
from unbroken.tune.tune_config import TuneConfig
from unbroken.tune.tuner import Tuner

__all__ = [
    "Callback", "Checkpoint", "CheckpointConfig", "FailureConfig", "ResultGrid", "RunConfig", "Stopper",
    "Trainable", "TrialResult", "TuneConfig", "Tuner",
    "choice", "grid_search", "lograndint", "loguniform", "qloguniform", "qlograndint", "qrandint", "qrandn",
    "quniform", "randint", "randn", "sample_from", "uniform", "with_parameters", "with_resources",
    "get_checkpoint", "get_context", "report",
]


def __getattr__(name: str) -> Any:
    _ray_names.refuse(__name__, name)  # a Ray Tune name unbroken does not provide: says what instead
