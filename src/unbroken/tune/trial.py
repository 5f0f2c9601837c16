"""One trial: the trainer that runs it, and the process that drives it.

A trial is an ordinary run. Its trainer is a `FunctionTrainer` around a function trainable (a
one-worker `DataParallelTrainer` that also reports what the function returns), or the user's
Trainer rebuilt with the trial's config merged into its arguments; its run directory is
`<sweep>/<trial name>/`. The sweep driver starts one driver per running trial (a process of
this machine, or an actor of the Ray cluster: see `trial_process`); it calls the trainer's
`fit()` -- a normal single-run driver with its own workers, lease, retries and checkpoints --
and says how it ended (`trial_outcome`).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import numbers
import os
import select
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

from unbroken.core import faults
from unbroken.core.codec import init_param_names
from unbroken.core.config import FailureConfig, RunConfig, ScalingConfig
from unbroken.core.processes import Carried, die_with_parent
from unbroken.core.run_spec import TrialInfo
from unbroken.errors import StorageNotSharedError, TrainingInterruptedError, UnbrokenError
from unbroken.execution.engine import kept_group
from unbroken.store import manifest as mf
from unbroken.store import sweep_manifest as sw
from unbroken.store.lease import live_holder
from unbroken.store.storage import Storage
from unbroken.train import report
from unbroken.train.trainer import BaseTrainer, DataParallelTrainer
from unbroken.tune.callback import split
from unbroken.tune.function_trainable import FunctionTrainable
from unbroken.tune.trainable import ClassRunner, is_trainable_class
from unbroken.worker.protocol import TrialDone, TrialFailed, TrialInterrupted, TrialOutcome, TrialTaken

log = logging.getLogger("unbroken")

# How long a trial's process waits for a leftover driver of the same trial to exit.
PREVIOUS_DRIVER_WAIT_S = 30.0
# Past the lease's TTL: how much longer a trial's driver waits for a previous driver's lease
# held on another machine.
REMOTE_HOLDER_MARGIN_S = 5.0
# Constructor arguments a param_space may not set: the sweep decides where each trial lives.
_RESERVED = ("run_config",)
# The metric a function trainable's returned (or yielded) number is reported as (Ray Tune's name).
DEFAULT_METRIC = "_metric"


def check_trainable(trainable: Any) -> None:
    if isinstance(trainable, BaseTrainer) or is_trainable_class(trainable):
        return
    if isinstance(trainable, type):
        raise TypeError(f"Tuner needs a function, a Trainer instance or a tune.Trainable subclass, got the "
                        f"class {trainable.__name__}. Hint: pass {trainable.__name__}(...) built with its "
                        "arguments, or a function (config) that calls tune.report or returns its metrics")
    if not callable(trainable):
        raise TypeError(f"Tuner needs a function (config) or a Trainer instance, got {trainable!r}")


def trainable_name(trainable: Any) -> str:
    if isinstance(trainable, BaseTrainer):
        return type(trainable).__name__
    return getattr(trainable, "__name__", type(trainable).__name__)


def check_param_space_keys(trainable: Any, space: dict[str, Any]) -> None:
    """A Trainer's param_space keys must be its constructor arguments (other than run_config)."""
    if not isinstance(trainable, BaseTrainer):
        return
    cls = type(trainable)
    valid = set(init_param_names(cls)) | set(trainable.init_args)
    for key in space:
        if key in _RESERVED or key not in valid:
            allowed = sorted(valid - set(_RESERVED))
            raise ValueError(
                f"param_space key {key!r} is not an argument {cls.__name__} lets a sweep set. Hint: with a "
                f"Trainer, param_space keys are its constructor arguments ({', '.join(allowed)}); put "
                "hyperparameters under 'train_loop_config', e.g. {'train_loop_config': {'lr': "
                "tune.loguniform(1e-4, 1e-1)}}")


def trial_scaling(trainable: Any) -> ScalingConfig:
    """What one trial's workers take: a Trainer's scaling_config, a function trainable's one
    worker (with `tune.with_resources`' resources; 1 CPU by default)."""
    if isinstance(trainable, BaseTrainer):
        return trainable.scaling_config
    if isinstance(trainable, FunctionTrainable):
        return trainable.scaling_config()
    return ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1})


def cpus_per_trial(trainable: Any) -> float:
    """CPUs one trial takes: its workers times their CPU resources (1 each by default)."""
    scaling = trial_scaling(trainable)
    per_worker = (scaling.resources_per_worker or {}).get("CPU") or 1
    return float(scaling.max_workers * per_worker)  # an elastic trial may grow to its most


def _merge(base: Any, override: Any) -> Any:
    """`override` deep-merged into `base` (dicts merge key by key; anything else replaces)."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            out[key] = _merge(base.get(key), value) if key in base else value
        return out
    return override


def trial_run_config(sweep: RunConfig, trial: str, sweep_url: str, stop: Any,
                     base: RunConfig | None = None) -> RunConfig:
    """The RunConfig of one trial: its directory in the sweep, and the settings of the sweep's
    RunConfig (a Trainer's own settings where the sweep's are left at their defaults)."""
    base = base or RunConfig()
    failure = sweep.failure_config if sweep.failure_config != FailureConfig() else base.failure_config
    checkpoint = (sweep.checkpoint_config if sweep.checkpoint_config != RunConfig().checkpoint_config
                  else base.checkpoint_config)
    callbacks = split(base.callbacks)[1] + split(sweep.callbacks)[1]  # the sweep's own stay with it
    return RunConfig(name=trial, storage_path=sweep_url, storage_filesystem=sweep.storage_filesystem,
                     failure_config=failure, checkpoint_config=checkpoint, stop=stop,
                     callbacks=callbacks or None, verbose=sweep.verbose if sweep.verbose >= 2 else 0,
                     resume="auto")


class FunctionTrainer(DataParallelTrainer):
    """The trainer of a function trainable's trial: a `DataParallelTrainer` that also reports
    what the function returns, as Ray Tune does. A dict is reported as one more row, after
    the rows the function reported itself; a number `v` as the row `{"_metric": v}`; `None`
    (or an empty dict) adds nothing; anything else fails the trial with a ValueError. A
    generator function has each value it yields reported the same way.

    The row goes through `train.report` like any other, so it is recorded exactly once in the
    trial's timeline: if the trial is killed after recording it, the resumed attempt runs the
    function again from the latest checkpoint and reports it again, replacing it.
    """

    def training_loop(self) -> None:
        returned = self._call_train_loop()
        if inspect.isgenerator(returned):
            for value in returned:
                report_returned(value)
        else:
            report_returned(returned)


def report_returned(value: Any) -> None:
    """Report what a function trainable returned or yielded (see FunctionTrainer)."""
    if value is None:
        return
    if isinstance(value, dict):
        if value:
            report(value)
        return
    if isinstance(value, numbers.Number):
        # Unlike Ray, which drops every falsy value, a 0 is reported: it is a result.
        report({DEFAULT_METRIC: value})
        return
    raise ValueError(f"a function trainable returned (or yielded) {type(value).__name__} {value!r:.80}; "
                     "it may return None, a dict of metrics (reported as its final row) or a number "
                     f"(reported as {{{DEFAULT_METRIC!r}: number}}). Hint: return {{'score': ...}}, or "
                     "call tune.report(...) and return nothing")


def build_trainer(trainable: Any, config: dict[str, Any], run_config: RunConfig) -> BaseTrainer:
    """The trainer that runs one trial with `config`."""
    if not isinstance(trainable, BaseTrainer):
        return FunctionTrainer(_loop(trainable, run_config), train_loop_config=config,
                               scaling_config=trial_scaling(trainable), run_config=run_config)
    args = dict(trainable.init_args)
    for key, value in config.items():
        args[key] = _merge(args.get(key), value)
    scaling = args.get("scaling_config")
    if isinstance(scaling, ScalingConfig) and scaling.resources_per_worker is None:
        # What the concurrency limit assumed; otherwise each trial's workers would split the
        # whole machine between them while other trials run too.
        args["scaling_config"] = dataclasses.replace(scaling, resources_per_worker={"CPU": 1})
    args["run_config"] = run_config
    return type(trainable)(**args)


def _loop(trainable: Any, run_config: RunConfig) -> Any:
    """What a function trainable's trial runs: the function, or a class trainable's runner."""
    function, parameters = trainable, {}
    if isinstance(trainable, FunctionTrainable):
        function, parameters = trainable.function, trainable.parameters
    if not is_trainable_class(function):
        return trainable
    checkpoints = run_config.checkpoint_config
    return ClassRunner(function, parameters, checkpoints.checkpoint_frequency, checkpoints.checkpoint_at_end)


# -- the trial's process ----------------------------------------------------------------------
@dataclass
class TrialPayload:
    trainer: BaseTrainer
    path: str                 # the trial's run directory
    info: dict[str, Any]      # trial_name, trial_id, trial_dir for train.get_context()
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # set in the trial's process
    continue_finished: bool = False  # population-based training: a paused (FINISHED) run goes on
    sweep_id: str | None = None  # on another machine: the sweep it must see (check_sees_sweep)
    reuse: bool = False  # TuneConfig(reuse_actors=True): the process runs the next trial it is given


def check_sees_sweep(payload: TrialPayload) -> None:
    """Fail before the trial starts when its driver, on another machine, does not see the
    sweep the sweep driver wrote: a storage path that is not shared by every node would put
    the trial's run where the sweep driver never reads it."""
    storage = Storage.from_url(payload.path, payload.trainer.run_config.storage_filesystem).parent()
    try:
        seen = sw.load(storage).sweep_id
    except (UnbrokenError, OSError) as e:
        seen = f"no sweep ({type(e).__name__})"
    if seen != payload.sweep_id:
        raise StorageNotSharedError(
            f"the driver of trial {payload.info.get('trial_name')} on {socket.gethostname()} does not see "
            f"the sweep {storage.url()!r} the sweep driver wrote (it sees {seen}). "
            f"{StorageNotSharedError.HINT}")


def _set_up_process(parent_pid: int | None) -> None:
    # The sweep driver's signal handlers were inherited through fork: restore the defaults
    # (the trial's Controller installs its own), in a process group of its own, so that a
    # Ctrl-C reaches only the sweep driver, which forwards it once to each trial.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        os.setpgrp()
    except OSError:
        pass
    die_with_parent(parent_pid)
    # The driver blocked these signals around the fork; one that arrived meanwhile lands now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})


def _wait_for_previous_driver(storage: Storage) -> None:
    """A trial driver left over from a sweep driver that was killed a moment ago is dying
    (PDEATHSIG, or Ray's ownership on a cluster) but may still hold the trial's lease: wait for
    that process to exit (woken by the exit itself) rather than fail with LeaseHeldError. Only
    the sweep driver holding the sweep's lease starts trial drivers, so a live holder is such
    a leftover. On another machine (a trial driver lost with its node) its exit cannot be
    seen from here: wait until its heartbeat is older than the lease's TTL."""
    holder = live_holder(storage)
    if holder is None or holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        return
    if holder.get("host") != socket.gethostname():
        deadline = time.monotonic() + float(holder.get("ttl_s", 30)) + REMOTE_HOLDER_MARGIN_S
        log.info("trial %s: waiting for the lease of the previous driver of this trial (on %s) to expire",
                 storage.url(), holder.get("host"))
        while live_holder(storage) is not None and time.monotonic() < deadline:
            time.sleep(1.0)
        return
    try:
        fd = os.pidfd_open(int(holder["pid"]))
    except (AttributeError, OSError, ValueError, KeyError):
        return
    try:
        log.info("trial %s: waiting for the previous driver of this trial (pid %s) to exit",
                 storage.url(), holder["pid"])
        select.select([fd], [], [], PREVIOUS_DRIVER_WAIT_S)
    finally:
        os.close(fd)


def run_trial(payload: TrialPayload) -> str:
    """Fit the trial's run: start it, or continue it from its latest committed checkpoint."""
    trainer = payload.trainer
    storage = Storage.from_url(payload.path, trainer.run_config.storage_filesystem)
    if mf.is_run_dir(storage):
        _wait_for_previous_driver(storage)
        if mf.load(storage).status == mf.FINISHED and not payload.continue_finished:
            return mf.FINISHED
        # Every argument is re-specified, so nothing stored is unpickled (allow_pickle=False
        # makes sure of it, whatever the trial's run.json says), and a param_space constant
        # re-specified on Tuner.restore amends the run (logged) instead of being refused.
        trainer = type(trainer).restore(payload.path, allow_pickle=False, **trainer.init_args)
    trainer.run_spec = trainer.run_spec.replace(
        trial=TrialInfo(**payload.info), elastic_start_limit=payload.trainer.run_spec.elastic_start_limit)
    return trainer.fit().status or mf.FINISHED


def trial_outcome(payload: TrialPayload) -> TrialOutcome:
    """Run the trial and say how it ended; never raises."""
    try:
        if payload.sweep_id is not None:
            check_sees_sweep(payload)
        return TrialDone(run_trial(payload))
    except TrainingInterruptedError as e:
        return TrialInterrupted(str(e).splitlines()[0])
    except BaseException as e:  # noqa: BLE001 - everything is reported to the sweep driver
        first = str(e).splitlines()[0] if str(e) else ""
        return TrialFailed(type(e).__name__, f"{type(e).__name__}: {first}"[:500], traceback.format_exc())


def trial_main(carried: Carried, conn: Any, parent_pid: int | None) -> None:
    """The body of a trial's process: one trial; with `reuse`, after each trial that ends
    cleanly (TrialDone), the next one the sweep driver sends on `conn`, until it sends None,
    each on the worker processes of the trial before (`kept_group`)."""
    _set_up_process(parent_pid)
    payload: TrialPayload | None = carried.obj
    kept_group.keep_groups(payload.reuse)
    while payload is not None:
        os.environ.update(payload.env)
        outcome = trial_outcome(payload)
        try:
            conn.send(outcome)
        except OSError:
            break
        if not (payload.reuse and isinstance(outcome, TrialDone)):
            break
        faults.point("trial_process_waits")  # crash tests: a kept trial process dies idle
        payload = _next_trial(conn)
    kept_group.release()
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()


def _next_trial(conn: Any) -> TrialPayload | None:
    """The next trial for a process that runs one after another, said taken (`TrialTaken`)
    before it begins; None when the sweep driver says there is none (it sends None: copies
    of its end of `conn` live on in processes forked after this one, so its closing it is
    not seen here) or is gone."""
    try:
        message = conn.recv()
        if message is None:
            return None
        conn.send(TrialTaken())
    except (EOFError, OSError):
        return None
    return message.obj
