"""Plain dataclass configurations, shared by the driver and the workers."""

from __future__ import annotations

import logging
import math
import os
import secrets
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

from unbroken.errors import UnsupportedOptionError

log = logging.getLogger("unbroken")

ENGINES = ("auto", "local", "ray")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class ScalingConfig:
    """How many workers run the training loop, and where.

    `engine`: "local" runs the workers as processes on this machine; "ray" runs them as
    actors of a Ray cluster; "auto" picks Ray when RAY_ADDRESS is set or the driver already
    called `ray.init()`, else local. `placement_strategy` and `accelerator_type` mean what
    they mean in Ray (a placement group's strategy; a node's accelerator type) and are
    accepted but have no effect on the local engine, where every rank is on this machine.
    `trainer_resources` (Ray Train V1): what each trial's driver actor holds in a sweep on a
    Ray cluster (nothing by default). A single run's driver runs in the calling process and
    takes no resources of its own, so there it has no effect (with a warning; Ray V2 refuses it).

    Elastic training (Ray V2's names): `num_workers=(min_workers, max_workers)` runs on as
    many workers as can be placed, between the two. A run starts with what is there (at
    least `min_workers`), continues on the workers left when one is lost instead of waiting
    for a replacement, and every `elastic_resize_monitor_interval_s` while it trains checks
    whether more can be placed and grows at the next report. Each resize is a new attempt
    from a checkpoint taken for it (or the newest one after a failure); a resize is not a
    failure. On the local engine the capacity is this machine: it always runs `max_workers`.
    """

    num_workers: int | tuple[int, int] = 1
    use_gpu: bool = False
    resources_per_worker: dict[str, float] | None = None
    engine: Literal["auto", "local", "ray"] = "auto"
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    accelerator_type: str | None = None
    trainer_resources: dict[str, float] | None = None
    elastic_resize_monitor_interval_s: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.num_workers, list):
            self.num_workers = tuple(self.num_workers)
        if isinstance(self.num_workers, tuple):
            pair = self.num_workers
            if len(pair) != 2 or not all(_is_int(v) and v >= 1 for v in pair) or pair[0] > pair[1]:
                raise ValueError(f"ScalingConfig.num_workers=(min_workers, max_workers) needs two ints with "
                                 f"1 <= min_workers <= max_workers, got {self.num_workers!r}. Hint: "
                                 "num_workers=(2, 4) trains on 2 to 4 workers")
        elif not _is_int(self.num_workers) or self.num_workers < 1:
            raise ValueError(f"ScalingConfig.num_workers must be an int >= 1, got {self.num_workers!r}")
        interval = self.elastic_resize_monitor_interval_s
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not interval > 0:
            raise ValueError(f"ScalingConfig.elastic_resize_monitor_interval_s must be > 0 seconds, "
                             f"got {interval!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"ScalingConfig.engine must be one of {ENGINES}, got {self.engine!r}")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"ScalingConfig.placement_strategy must be one of {PLACEMENT_STRATEGIES}, "
                             f"got {self.placement_strategy!r}")
        if self.trainer_resources is not None:
            log.warning("ScalingConfig(trainer_resources=%r) has no effect on a single run, whose driver "
                        "runs in the calling process; in a sweep on a Ray cluster each trial's driver "
                        "actor holds them", self.trainer_resources)

    @property
    def elasticity_enabled(self) -> bool:
        """num_workers is a (min_workers, max_workers) range (Ray V2)."""
        return isinstance(self.num_workers, tuple)

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if isinstance(self.num_workers, tuple) else self.num_workers

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if isinstance(self.num_workers, tuple) else self.num_workers

    def fixed(self, num_workers: int) -> ScalingConfig:
        """This config at one size: what one attempt of an elastic run runs with."""
        return replace(self, num_workers=num_workers)

    @property
    def worker_resources(self) -> dict[str, float]:
        """What one worker needs: CPU 1 and, with use_gpu, GPU 1, unless `resources_per_worker`
        says otherwise."""
        per = {k: float(v) for k, v in (self.resources_per_worker or {"CPU": 1.0}).items()}
        if self.use_gpu:
            per.setdefault("GPU", 1.0)
        return per

    @property
    def total_resources(self) -> dict[str, float]:
        """What the workers need in all (Ray V2): `worker_resources` times num_workers (the
        most workers, for an elastic run)."""
        return {name: amount * self.max_workers for name, amount in self.worker_resources.items()}

    def cpus_per_worker(self) -> int:
        """Intra-op threads each worker gets: its CPU resources, or an even share of this machine."""
        cpus = (self.resources_per_worker or {}).get("CPU")
        if cpus:
            return max(1, int(cpus))
        return max(1, (os.cpu_count() or 1) // self.max_workers)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# FailureConfig.recovery's levels, weakest first.
RECOVERY_LEVELS = ("checkpoint", "just_in_time", "in_place")
# FailureConfig(hang_timeout_s="auto"): a multiple of the longest time between two report
# rounds, never under half an hour (an evaluation or a large save between two reports must
# not look like a hang).
AUTO_HANG_FACTOR = 20.0
AUTO_HANG_MIN_S = 1800.0
# The clouds whose spot notices FailureConfig(preemption_notices=...) can poll (None: none).
PREEMPTION_NOTICES = (None, "aws", "gce")


@dataclass
class FailureConfig:
    """How many times the worker group restarts after a failure within one fit() (-1: unlimited).

    `hang_timeout_s`: when no rank has reported for this long (counted from the attempt's
    start and from each report), the worker group is treated as hung (a deadlocked
    collective, a rank stuck in I/O) and handled like a worker failure. None: wait forever.
    "auto" (the default): a bound that suits the run (`hang_bound`): none until the attempt
    has completed two report rounds, then `AUTO_HANG_FACTOR` times the longest time between
    two of its rounds so far, and never under `AUTO_HANG_MIN_S`.

    Preemption (see `unbroken.execution.notices`): a notice that machines of the run go away
    at a deadline commits a checkpoint before it and stops the attempt as PREEMPTED, which is
    not a failure. Notices are a SIGTERM to the driver or to a local worker process, with
    `sigterm_grace_s` left before the kill (Kubernetes' terminationGracePeriodSeconds, 30 s by
    default); a Ray node drain (the Ray engine); and, only when `preemption_notices` names the
    cloud ("aws", "gce"; or the UNBROKEN_PREEMPTION_NOTICES environment variable), the
    provider's spot notice, polled from the driver machine's metadata endpoint. A notice for
    the driver's machine ends the run (INTERRUPTED); after a drain the run goes on without
    the node, and Ray Train V2's `max_preemption_failures` (-1: unlimited, the default)
    bounds how many preempted attempts of one fit() it goes on after, apart from
    `max_failures`; its
    `controller_failure_limit` is accepted so that V2 scripts run unchanged, and has no
    effect: the controller is the driver process itself (a killed driver's run continues when
    the script runs again, or under `unbroken run`). `fail_fast` (V1) raises at the first failure;
    in a sweep, a trial's error also ends the sweep (`"raise"`: and fit() raises it), as in Tune.

    `recovery`: how a run whose loop keeps its state in a `TrainState` recovers from a failed
    rank, one of `RECOVERY_LEVELS`, weakest first ("in_place", the strongest, by default):
    - "checkpoint": every rank starts again from the latest committed checkpoint; the steps
      since it are redone (a loop without a TrainState always recovers so).
    - "just_in_time": first, a surviving rank whose state is clean since the last report saves
      that report round as a checkpoint (the run's TrainState tracks it: see
      `unbroken.worker.recovery.just_in_time`); at most the step in flight is redone.
    - "in_place": the surviving ranks keep their processes, only the failed ranks are started
      again, and the state of the last complete report goes from a survivor to every rank
      over the new process group instead of through storage (local and Ray engines; an
      elastic run goes on without the ranks lost with their node: a shrink in place).
      Whenever no survivor holds a clean state, the run falls back to the level below.
    Each still counts as a failure against `max_failures`, and each ends bit for bit as the
    run would have without the failure. With "in_place" and a `hang_timeout_s` in seconds,
    torch.distributed's collective timeout becomes half as long again
    (`collective_timeout_s`), so that ranks blocked in a collective with a machine that
    vanished (its connections stay open) are released, and stay. `recover_in_place=True` is
    the older spelling of `recovery="in_place"` (deprecated).
    """

    max_failures: int = 0
    fail_fast: bool | str = False
    hang_timeout_s: float | str | None = "auto"
    recovery: str = "in_place"
    recover_in_place: bool = False
    controller_failure_limit: int = -1
    max_preemption_failures: int = -1
    sigterm_grace_s: float = 30.0
    preemption_notices: str | None = None
    # A run stored before `recovery` existed recovered from its latest checkpoint, with plain
    # random streams: restored, it goes on so (see `core.codec.decode`).
    STORED_BEFORE: ClassVar[dict[str, Any]] = {"recovery": "checkpoint"}

    def __post_init__(self) -> None:
        for name in ("max_failures", "controller_failure_limit", "max_preemption_failures"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < -1:
                raise ValueError(f"FailureConfig.{name} must be an int >= -1 (-1: unlimited), got {value!r}")
        if self.fail_fast not in (True, False, "raise"):
            raise ValueError(f"FailureConfig.fail_fast must be True, False or 'raise', got "
                             f"{self.fail_fast!r}")
        if self.hang_timeout_s not in (None, "auto") and not (
                isinstance(self.hang_timeout_s, (int, float)) and self.hang_timeout_s > 0):
            raise ValueError(f"FailureConfig.hang_timeout_s must be None, 'auto' or > 0, got "
                             f"{self.hang_timeout_s!r}. Hint: hang_timeout_s=None waits for ever")
        if not (isinstance(self.sigterm_grace_s, (int, float)) and self.sigterm_grace_s > 0):
            raise ValueError(f"FailureConfig.sigterm_grace_s must be > 0 (seconds), got "
                             f"{self.sigterm_grace_s!r}")
        if self.preemption_notices not in PREEMPTION_NOTICES:
            raise ValueError(f"FailureConfig.preemption_notices must be one of {PREEMPTION_NOTICES}, got "
                             f"{self.preemption_notices!r}. Hint: name the cloud whose spot notices to poll")
        if self.recovery not in RECOVERY_LEVELS:
            levels = ", ".join(map(repr, RECOVERY_LEVELS))
            raise ValueError(f"FailureConfig.recovery must be one of {levels}, got {self.recovery!r}. "
                             "Hint: recovery='in_place' recovers a failed rank without redoing a step")
        if self.recover_in_place:
            warnings.warn("FailureConfig(recover_in_place=True) is deprecated: it means "
                          "FailureConfig(recovery='in_place'), the default", DeprecationWarning, stacklevel=3)
            self.recovery = "in_place"

    def hang_bound(self, longest_round_s: float | None) -> float | None:
        """How long the group may go without a message before it counts as hung, given the
        longest time between two of the attempt's report rounds so far (None: fewer than two
        rounds): `hang_timeout_s`, or for "auto" a multiple of that longest time."""
        if self.hang_timeout_s != "auto":
            return self.hang_timeout_s
        if longest_round_s is None:
            return None
        return max(AUTO_HANG_MIN_S, AUTO_HANG_FACTOR * longest_round_s)

    def recovers(self, level: str) -> bool:
        """Whether this run's recovery is at least `level` (one of `RECOVERY_LEVELS`)."""
        return RECOVERY_LEVELS.index(self.recovery) >= RECOVERY_LEVELS.index(level)

    @property
    def collective_timeout_s(self) -> float | None:
        """How long a rank may wait in one torch.distributed collective before it fails, when
        the run says (else TorchConfig.timeout_s): in a run that recovers in place, 1.5 times
        the hang bound. A rank waiting that long is hung by the run's own rule, and its error
        lets it offer its state and stay; the margin lets the driver's hang check come first,
        which can tell a frozen rank from the ones waiting on it and kill it alone."""
        if not isinstance(self.hang_timeout_s, (int, float)) or not self.recovers("in_place"):
            return None
        return 1.5 * self.hang_timeout_s


@dataclass
class CheckpointConfig:
    """Which committed checkpoints to keep (`num_to_keep`, ranked by
    `checkpoint_score_attribute` in `checkpoint_score_order`, as in Ray), and
    `mean_time_between_failures_s`: the MTBF that `TrainState.report(..., checkpoint="auto")`
    and `unbroken show`'s advice assume until the run has failed (then: its own rate).
    `checkpoint_frequency` and `checkpoint_at_end`: for class trainables (`tune.Trainable`)
    only, as in Ray: save every N steps (0: never), and with the step that returns done=True."""

    num_to_keep: int | None = None
    checkpoint_score_attribute: str | None = None
    checkpoint_score_order: Literal["max", "min"] = "max"
    mean_time_between_failures_s: float | None = None
    checkpoint_frequency: int = 0
    checkpoint_at_end: bool | None = None

    def __post_init__(self) -> None:
        if self.num_to_keep is not None and self.num_to_keep < 1:
            raise ValueError("CheckpointConfig.num_to_keep must be None or >= 1")
        if self.mean_time_between_failures_s is not None and not self.mean_time_between_failures_s > 0:
            raise ValueError(f"CheckpointConfig.mean_time_between_failures_s must be > 0 seconds, got "
                             f"{self.mean_time_between_failures_s!r}. Hint: leave it None to assume an "
                             "hour until the run has failed")
        if self.checkpoint_score_order not in ("max", "min"):
            raise ValueError("CheckpointConfig.checkpoint_score_order must be 'max' or 'min'")
        if isinstance(self.checkpoint_frequency, bool) or not isinstance(self.checkpoint_frequency, int) \
                or self.checkpoint_frequency < 0:
            raise ValueError(f"CheckpointConfig.checkpoint_frequency must be an int >= 0 (steps between a "
                             f"class trainable's checkpoints; 0: none), got {self.checkpoint_frequency!r}")


def generated_name(prefix: str) -> str:
    """A run or sweep name for RunConfig(name=None): `<prefix>_<YYYY-mm-dd_HH-MM-SS>_<8 hex>`.
    Ray's names stop at the second; two runs started in the same second then shared a
    directory, and the second fit() returned the first one's result."""
    return f"{prefix}_{time.strftime('%Y-%m-%d_%H-%M-%S')}_{secrets.token_hex(4)}"


@dataclass
class RunConfig:
    """Where a run lives and how it behaves. `name` and `storage_path` identify the run.
    Without a `name`, fit() gives the run a new one of its own (`generated_name`), which is
    never that of an existing run: auto-resume is for names you chose.

    `resume`: what fit() does with an existing run of the same name ("auto": continue it;
    "never": refuse; "must": refuse when there is none). `allow_config_change`: continue an
    existing run even where this script's configuration (train_loop_config, other plain
    arguments, dataset names) differs from the one the run was started with, for example to
    train a finished run for more epochs; the change is recorded with the attempt and shown
    by `unbroken show`. Without it such a fit() raises IdentityMismatchError, so that two
    configurations are never mixed in one run by accident.

    `worker_runtime_env` (Ray Train V2): only `{"env_vars": {...}}` is supported, set in
    every worker's environment before the backend starts; the workers run in this Python
    environment, so Ray's other runtime_env keys (pip, conda, working_dir, ...) are refused.
    """

    name: str | None = None
    storage_path: str | None = None
    storage_filesystem: Any = None
    failure_config: FailureConfig | None = None
    checkpoint_config: CheckpointConfig | None = None
    stop: dict[str, float] | Callable[[dict], bool] | None = None
    callbacks: list[Any] | None = None
    verbose: int = 1
    resume: Literal["auto", "never", "must"] = "auto"
    allow_config_change: bool = False
    worker_runtime_env: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.resume not in ("auto", "never", "must"):
            raise ValueError(f"RunConfig.resume must be 'auto', 'never' or 'must', got {self.resume!r}")
        if not isinstance(self.allow_config_change, bool):
            raise TypeError(f"RunConfig.allow_config_change must be True or False, got "
                            f"{self.allow_config_change!r}")
        self.worker_env()  # checks worker_runtime_env
        if self.failure_config is None:
            self.failure_config = FailureConfig()
        if self.checkpoint_config is None:
            self.checkpoint_config = CheckpointConfig()

    def worker_env(self) -> dict[str, str]:
        """The environment variables `worker_runtime_env` sets in each worker."""
        runtime_env = self.worker_runtime_env or {}
        if not isinstance(runtime_env, dict):
            raise TypeError(f"RunConfig.worker_runtime_env must be a dict, got {type(runtime_env).__name__}")
        others = sorted(set(runtime_env) - {"env_vars"})
        if others:
            raise UnsupportedOptionError(
                f"RunConfig(worker_runtime_env=...) supports only 'env_vars', not {', '.join(others)}: the "
                "workers run in the driver's Python environment, with its packages and its sys.path. "
                "Hint: install what the workers need where the script runs, and drop those keys")
        env_vars = runtime_env.get("env_vars") or {}
        if not isinstance(env_vars, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items()):
            raise TypeError("RunConfig(worker_runtime_env={'env_vars': ...}) needs a dict of str to str, "
                            f"got {env_vars!r}")
        return dict(env_vars)

    def resolved_storage_path(self) -> str:
        """The storage root: the given path, else $UNBROKEN_STORAGE, else ~/unbroken_results."""
        if self.storage_path:
            return str(self.storage_path)
        return os.environ.get("UNBROKEN_STORAGE") or os.path.expanduser("~/unbroken_results")


def stop_due_at(stop: Any) -> int | None:
    """The first iteration whose report `RunConfig.stop` may stop at, where it can say: a dict's
    `training_iteration`, or a stopper's `verdict_from()` (population-based training's pause
    at its next perturbation point); None when any report may be the last."""
    if isinstance(stop, dict) and isinstance(stop.get("training_iteration"), (int, float)):
        return math.ceil(stop["training_iteration"])
    verdict_from = getattr(stop, "verdict_from", None)
    return verdict_from() if callable(verdict_from) else None


def stop_met_at_resume(stop: Any, row: dict[str, Any]) -> bool:
    """Whether a run that resumes from the checkpoint of `row` had already met `RunConfig.stop`
    there (its driver died after that last report and before the run was recorded as
    finished): then it is finished, and runs no further iteration. A stopper of a sweep says
    with its `met_at_resume(row)`; one that cannot say is not asked."""
    if isinstance(stop, dict):
        return stop_met(stop, row)
    met_at_resume = getattr(stop, "met_at_resume", None)
    if callable(met_at_resume):
        return bool(met_at_resume(row))
    return False


def stop_met(stop: Any, row: dict[str, Any]) -> bool:
    """`RunConfig.stop`'s meaning for a metric row: a callable's verdict, or any
    `key >= threshold` of a dict."""
    if not stop:
        return False
    if callable(stop):
        return bool(stop(row))
    return any(key in row and row[key] >= threshold for key, threshold in stop.items())
