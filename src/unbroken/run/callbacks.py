"""Driver-side callbacks: the `Callback` hooks users subclass, the read-only `RunInfo` they
receive, and the dispatch that keeps a failing callback from failing the run.

The run directory (`unbroken.run.handle.Run`) calls the dispatch at each event of a run: an
attempt starts, a report round is recorded, a checkpoint commits, an attempt ends, the
run ends. Callbacks run in the driver process only, in the order given, after the event
is on storage. This module does not import `run` (nor `progress`, one of the callbacks):
they depend on it, not the other way round.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from unbroken.run import goodput
from unbroken.run.goodput import Goodput
from unbroken.run.hook_thread import HookThread
from unbroken.store import history
from unbroken.store.checkpoint import Checkpoint
from unbroken.store.manifest import META_DIR

if TYPE_CHECKING:
    from unbroken.store.commit import Marker
    from unbroken.store.manifest import Attempt, RunManifest
    from unbroken.store.storage import Storage

log = logging.getLogger("unbroken")

STATE_DIR = f"{META_DIR}/callbacks"
# Fields every row carries that are bookkeeping rather than measurements.
# The timings every row (time_checkpoint_s: a row that saved) carries: plotted and logged, but
# not what a progress line or a listing shows as the run's metric.
TIMINGS = ("time_total_s", "time_this_iter_s", "time_checkpoint_s")
BOOKKEEPING = frozenset({"training_iteration", "iterations_since_restore", "time_since_restore",
                         "timestamp", "attempt", "checkpoint_dir_name", "world_size",
                         "straggler_rank", "straggler_ratio"})


class ObservedRun(Protocol):
    """What the dispatch reads from the run it reports on (`unbroken.run.handle.Run`)."""

    storage: Storage
    manifest: RunManifest
    attempt: Attempt | None

    @property
    def path(self) -> str: ...


@dataclass(frozen=True)
class _RunAtEvent:
    """What a background callback's hook sees: the run as it was when the event happened."""

    storage: Storage
    manifest: RunManifest
    attempt: Attempt | None
    path: str


class RunInfo:
    """What a callback may know about the run it observes. Read-only, except for the
    callback's own small state file (`load_state` / `save_state`), which lives in the run
    directory so that it survives resumes."""

    def __init__(self, run: ObservedRun) -> None:
        self._run = run

    def at_event(self) -> RunInfo:
        """A copy fixed at this moment (the attempt as it is now), for a hook run later."""
        run = self._run
        return RunInfo(_RunAtEvent(run.storage, run.manifest, copy.copy(run.attempt), run.path))

    @property
    def name(self) -> str:
        return self._run.manifest.name

    @property
    def path(self) -> str:
        """The run directory (a local path, or a URL on object stores)."""
        return self._run.path

    @property
    def local_path(self) -> str | None:
        """The run directory on this machine's filesystem, or None on an object store."""
        return self._run.storage.local_path()

    @property
    def run_id(self) -> str:
        """A random id fixed when the run was created; the same in every attempt."""
        return self._run.manifest.run_id

    @property
    def attempt(self) -> int:
        """The current attempt's number (1, 2, ...), or 0 before the first one."""
        return self._run.attempt.number if self._run.attempt else 0

    @property
    def resumed_from(self) -> str | None:
        """The checkpoint the current attempt resumed from (None for a fresh start)."""
        return self._run.attempt.resumed_from if self._run.attempt else None

    @property
    def resumed_iteration(self) -> int:
        """The iteration the current attempt resumed from; its first row is this plus one."""
        return self._run.attempt.resumed_iteration if self._run.attempt else 0

    @property
    def config(self) -> Any:
        """The run's train_loop_config as saved (objects shown as {"__object__": type name})."""
        return self._run.manifest.identity.get("train_loop_config")

    def time_spent(self) -> Goodput:
        """Where the run's time went so far (`unbroken.run.goodput`), read from its files."""
        attempts = [dataclasses.asdict(a) for a in self._run.manifest.attempts]
        return goodput.of_run(attempts, history.read_rows(self._run.storage))

    def load_state(self, key: str) -> Any:
        """The JSON value saved under `key` by `save_state`, or None."""
        try:
            return json.loads(self._run.storage.read_bytes(f"{STATE_DIR}/{key}.json"))
        except (FileNotFoundError, ValueError):
            return None

    def save_state(self, key: str, value: Any) -> None:
        """Keep a small JSON value in the run directory, replaced atomically."""
        self._run.storage.makedirs(STATE_DIR)
        self._run.storage.write_atomic(f"{STATE_DIR}/{key}.json", json.dumps(value, sort_keys=True).encode())


class Callback:
    """Hooks called by the driver while a run trains. Every method does nothing by default;
    override the ones you need and pass instances in `RunConfig(callbacks=[...])`.

    Callbacks run in the driver process only. A callback never stops the run: the first
    time one of its hooks raises, one warning says so and the callback is not called again
    in this fit(). Callbacks are saved with the run config, so keep open files, clients and
    threads out of pickling (create them in a hook, drop them in `__getstate__`).
    """

    #: False: the hooks run on the driver's thread as each event happens, so they hold up
    #: the report path for as long as they take. True (the loggers): they run in the same
    #: order on a thread of this callback's own, off the report path; each call is bounded
    #: by `hook_timeout_s`, after which the callback is given up for the rest of the fit().
    #: `run` then describes the run as it was at the event.
    run_in_background: bool = False
    hook_timeout_s: float = 15.0

    def setup(self, run: RunInfo) -> None:
        """Once per fit(), before the first attempt starts."""

    def on_attempt_start(self, run: RunInfo) -> None:
        """An attempt begins; `run.attempt` and `run.resumed_iteration` describe it."""

    def on_result(self, run: RunInfo, metrics: dict[str, Any]) -> None:
        """A report round was recorded: rank 0's metrics plus `training_iteration`,
        `iterations_since_restore`, `time_total_s`, `time_since_restore`, `time_this_iter_s`,
        `timestamp`, `attempt`, `checkpoint_dir_name`."""

    def on_checkpoint(self, run: RunInfo, checkpoint: Checkpoint, metrics: dict[str, Any]) -> None:
        """A checkpoint committed; `metrics` is the row of its iteration."""

    def on_attempt_end(self, run: RunInfo, status: str, error: BaseException | None) -> None:
        """An attempt ended as FINISHED, ERRORED, INTERRUPTED, PREEMPTED or RESIZED (with its
        error, if any)."""

    def on_run_end(self, run: RunInfo, status: str) -> None:
        """fit() is about to return or raise; the run is FINISHED, ERRORED or INTERRUPTED."""


class UserCallback:
    """Ray Train V2's callback interface, for scripts ported from Ray: pass instances in
    `RunConfig(callbacks=[...])`, next to (or instead of) `Callback`s. Same rules: the
    driver calls them, in order, after the event is on storage, and a failing one is logged,
    never fatal. `run_context` is the run's `RunInfo` (name, path, attempt, config, ...).

    Across a crash a hook may see a report twice: the rounds after the last committed
    checkpoint run again in the next attempt (`run_context.resumed_iteration` says where it
    resumed). The run's metric history keeps each iteration once.
    """

    def after_report(self, run_context: RunInfo, metrics: list[dict[str, Any]],
                     checkpoint: Checkpoint | None) -> None:
        """Every rank reported: `metrics[i]` is what rank i passed to `train.report`;
        `checkpoint` is the committed checkpoint of this report, or None."""

    def after_exception(self, run_context: RunInfo, worker_exceptions: dict[int, Exception]) -> None:
        """An attempt failed: the error by the rank that failed (-1 when it was not a rank's:
        storage, the driver's bookkeeping). The run may restart (FailureConfig.max_failures)."""


class CallbackList:
    """Calls every callback at each event and contains their failures."""

    def __init__(self, callbacks: list[Callback] | None = None) -> None:
        self.callbacks = list(callbacks or [])
        for cb in self.callbacks:
            if not isinstance(cb, (Callback, UserCallback)):
                raise TypeError(f"RunConfig.callbacks must hold Callback or UserCallback instances, "
                                f"got {cb!r}. Hint: subclass unbroken.train.Callback (or "
                                "unbroken.train.UserCallback, Ray Train V2's interface)")
        self.info: RunInfo | None = None
        self._set_up = False
        self._broken: set[int] = set()  # failed once: not called again in this fit()
        self._threads: dict[int, HookThread] = {}  # of the callbacks that run in the background

    def bind(self, run: ObservedRun) -> CallbackList:
        """Attach to the run whose events this list will receive."""
        self.info = RunInfo(run)
        return self

    def _each(self, method: str, *args: Any) -> None:
        for cb in self.callbacks:
            if id(cb) in self._broken:
                continue
            hook = getattr(cb, method, None)
            if hook is None:
                continue  # a Callback has no after_report, a UserCallback no on_result
            if getattr(cb, "run_in_background", False):
                self._thread(cb).submit(method, functools.partial(hook, self.info.at_event(), *(
                    copy.copy(a) if isinstance(a, (dict, list)) else a for a in args)))
                continue
            try:
                hook(self.info, *args)
            except Exception as e:
                self._give_up(cb, f"failed in {method}", e)

    def _thread(self, cb: Callback | UserCallback) -> HookThread:
        if id(cb) not in self._threads:
            timeout = float(getattr(cb, "hook_timeout_s", Callback.hook_timeout_s))
            self._threads[id(cb)] = HookThread(type(cb).__name__, timeout,
                                               lambda why, error: self._give_up(cb, why, error))
        return self._threads[id(cb)]

    def _give_up(self, cb: Callback | UserCallback, why: str, error: BaseException | None) -> None:
        self._broken.add(id(cb))
        cause = f" ({type(error).__name__}: {error})" if error is not None else ""
        log.warning("callback %s %s%s; the run goes on without it: it is not called again in this fit()",
                    type(cb).__name__, why, cause,
                    exc_info=error if log.isEnabledFor(logging.DEBUG) else None)

    def attempt_started(self) -> None:
        if not self.callbacks:
            return
        if not self._set_up:
            self._set_up = True
            self._each("setup")
        self._each("on_attempt_start")

    def result(self, row: dict[str, Any]) -> None:
        if self.callbacks:
            self._each("on_result", dict(row))

    def checkpoint(self, marker: Marker) -> None:
        if self.callbacks:
            self._each("on_checkpoint", self._handle(marker), dict(marker.metrics))

    def _handle(self, marker: Marker) -> Checkpoint:
        storage = self.info._run.storage
        return Checkpoint(storage.url(marker.name), storage.filesystem_arg)

    def reported(self, metrics: list[dict[str, Any]], marker: Marker | None) -> None:
        if self.callbacks:
            self._each("after_report", [dict(m) for m in metrics],
                       self._handle(marker) if marker is not None else None)

    def attempt_ended(self, status: str, error: BaseException | None) -> None:
        if self.callbacks:
            self._each("on_attempt_end", status, error)
            if isinstance(error, Exception):
                self._each("after_exception", {failed_rank(error): error})

    def run_ended(self, status: str) -> None:
        if self.callbacks and self._set_up:
            self._each("on_run_end", status)
            for thread in self._threads.values():
                thread.drain()
            self._threads.clear()
            self._set_up = False  # a later fit() on the same Run sets them up again


def numeric_metrics(row: dict[str, Any]) -> dict[str, float]:
    """The row's numbers worth plotting: ints and floats, not bools, not bookkeeping fields."""
    return {k: float(v) for k, v in row.items()
            if k not in BOOKKEEPING and isinstance(v, (int, float)) and not isinstance(v, bool)}


def failed_rank(error: BaseException) -> int:
    """The rank an attempt's error came from (a WorkerError's, or the one a worker's own
    exception carries as its cause), or -1 when it did not come from a rank."""
    for e in (error, error.__cause__):
        rank = getattr(e, "rank", None)
        if isinstance(rank, int):
            return rank
    return -1
