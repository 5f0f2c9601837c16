"""The sweep driver: runs a sweep's trials, up to the concurrency limit, each in a process of
its own, and keeps the sweep manifest in step with them.

The driver holds the sweep's lease and is the only writer of sweep.json. It stays able to
fork: it runs no torch ops and starts no threads. For each trial it starts a process
(`trial.trial_main`) and then waits, without polling, on the trial processes' sentinels and
pipes and on the signal pipe; its wait has a timeout only to pace the lease heartbeat.
When a trial process ends, the driver reads the trial's outcome (its message, its run's
status, the scheduler's decision), tells the searcher, and saves the manifest. A driver
killed in between leaves the manifest behind the trial's run; the next fit() reconciles
the two (`reconciled`, in `sweep_preparation`) before anything else, and crash tests stop a
driver right there with the fault point `before_trial_record` (unbroken.core.faults).

SIGTERM or SIGINT to the sweep driver is forwarded once to every running trial (trial
processes have process groups of their own, so a Ctrl-C reaches them only this way); each
trial's driver then checkpoints and stops as a single run does, no new trial starts, and
fit() raises TrainingInterruptedError once every trial process has ended. A second signal
is forwarded too, so the trials stop at once. If the sweep driver is killed, the kernel
kills the trial processes (PDEATHSIG), and theirs kill their workers; Tuner.restore
continues from what is on disk.

With `TuneConfig(reuse_actors=True)` (trials on this machine), a trial's process that ends
its trial cleanly is kept, idle, and the next trial to start runs in it instead of a new
one, on the same worker processes (see `running_trials`, `trial_process`). What a trial
records is the same either way; a kept process that dies is replaced by a new one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from unbroken.core import faults
from unbroken.errors import TrainingFailedError, TrainingInterruptedError
from unbroken.execution.engine.factory import engine_env
from unbroken.execution.preemption import Interrupts
from unbroken.observe.progress import sweep_progress
from unbroken.store import sweep_manifest as sw
from unbroken.store.lease import Lease
from unbroken.store.sweep_manifest import TrialRecord
from unbroken.tune import asha, gpu_slots
from unbroken.tune import search_space as ss
from unbroken.tune.gpu_slots import GpuSlots
from unbroken.tune.running_trials import Running, RunningTrials
from unbroken.tune.sweep_events import trial_id
from unbroken.tune.sweep_preparation import PreparedSweep
from unbroken.tune.sweep_stop import fail_fast, mark_stopped, trial_stopper
from unbroken.tune.trial import TrialPayload, build_trainer, trial_run_config
from unbroken.tune.trial_process import LocalTrialProcess
from unbroken.tune.trial_slots import TrialSlots, holding
from unbroken.worker.protocol import TrialDone, TrialFailed, TrialInterrupted, TrialPlaced

log = logging.getLogger("unbroken")

# How many times a trial whose driver was lost with its node runs again before it errs.
MAX_RELAUNCHES = 10


@dataclass(kw_only=True)
class SweepDriver(PreparedSweep):
    """One fit() of a sweep, by the driver that holds the sweep's lease: runs the trials that
    `prepare` queued, and those the searcher proposes while they run."""

    lease: Lease
    concurrency: int
    verbose: int = 1
    slots: TrialSlots | None = None  # on a Ray cluster: the share of the cluster the next trial gets
    gpus: GpuSlots | None = None  # on the local engine, when trials take GPUs: which are free
    on_ray: bool = False  # trials' drivers are actors of the Ray cluster (ray_trial_process)
    reuse: bool = False  # TuneConfig(reuse_actors=True): a trial's process runs later trials too
    relaunching: dict[str, Callable[[], bool]] = field(default_factory=dict)  # queued after a lost driver
    _done_at_start: int = 0  # trials already done when execute() began

    def save(self) -> None:
        """Save the manifest with the sweep callbacks' states in it: each write that moves a
        mark of what they were given holds the states they have after it (tune.callback)."""
        if self.events is not None:
            self.events.states.capture()
        super().save()
        if self.events is not None:
            self.events.states.saved()

    def _say(self, message: str, *args: Any) -> None:
        if self.verbose >= 1:
            log.info("sweep %s: " + message, self.name, *args)

    # -- running ----------------------------------------------------------------------------
    def _next(self) -> TrialRecord | None:
        for name in list(self.queue):
            ready = self.relaunching.get(name)
            if ready is not None and not ready():
                continue  # its driver's node was lost a moment ago (see `_relaunch`)
            self.relaunching.pop(name, None)
            self.queue.remove(name)
            record = self.manifest.trial(name)
            if record is not None and record.status not in (*sw.DONE, sw.PAUSED, sw.RUNNING):
                return record
        if len(self.manifest.trials) < self.total:
            assert self.ctx is not None
            values, searcher_id = self.searcher.propose(self.ctx, len(self.manifest.trials))
            record = self._new_record(values, searcher_id)
            self.save()
            return record
        return None

    def _trainer(self, record: TrialRecord) -> Any:
        stop = trial_stopper(self._trial_stop(record), self.population, self.scheduler, self.metric,
                             self.mode)
        rc = trial_run_config(self.run_config, record.name, self.storage.url(), stop,
                              getattr(self.trainable, "run_config", None))
        return build_trainer(self.trainable, self._config_of(record.name), rc)

    def _launch(self, record: TrialRecord, running: RunningTrials,
                share: int | None = None) -> Running | None:
        try:
            trainer = self._trainer(record)
            trainer.run_spec = trainer.run_spec.replace(elastic_start_limit=share)  # a Ray cluster's share
        except Exception as e:  # a config the trainer refuses: the trial fails, the sweep goes on
            self._ended(record, sw.ERROR, f"{type(e).__name__}: {e}".splitlines()[0])
            return None
        url = self.storage.url(record.name)
        info = {"trial_name": record.title or record.name, "trial_id": trial_id(self.manifest, record),
                "trial_dir": url}
        idle, reused = running.take_idle(), False  # a process that ran an earlier trial and waits
        env, gpus = engine_env(), None
        if self.gpus is not None:
            gpus = idle.gpus if idle is not None else self.gpus.take()
        if gpus is not None:
            env[gpu_slots.ENV] = ",".join(gpus)
        payload = TrialPayload(trainer, url, info, env, self.population is not None, reuse=self.reuse)
        if self.on_ray:
            from unbroken.tune.ray_trial_process import RayTrialProcess

            payload.sweep_id = self.manifest.sweep_id
            proc: Any = RayTrialProcess(payload, trainer.scaling_config.trainer_resources)
        elif idle is not None and idle.proc.give(payload):
            proc, reused = idle.proc, True
        else:
            if idle is not None:
                idle.proc.join()  # it died waiting; its GPUs go to the new process
            proc = LocalTrialProcess(payload, record.name)
        record.driver = None
        record.status, record.started_at, record.ended_at, record.error = sw.RUNNING, time.time(), None, None
        self.save()
        if self.events is not None:
            self.events.started(record)
        return Running(record, proc, share=share or 0, gpus=gpus or [], taken=not reused)

    def _ended(self, record: TrialRecord, status: str, error: str | None = None) -> None:
        # Crash tests: the trial's run has recorded its end, the sweep manifest not yet.
        faults.point("before_trial_record")
        record.status, record.error, record.ended_at = status, error, time.time()
        record.end_due = status in sw.DONE and self.events is not None and bool(self.events.callbacks)
        if status == sw.TERMINATED and isinstance(self.scheduler, asha.ASHAScheduler):
            decision = asha.read_decision(self.storage, record.name)
            record.stopped_early = asha.describe_decision(decision) if decision else None
        if status in sw.DONE:
            self._tell(record)
        self.save()
        if status in sw.DONE and self.events is not None:
            self.events.ended(record)
        ends_sweep = status == sw.ERROR and fail_fast(self.trainable, self.run_config)
        if ends_sweep and self.manifest.stopped is None:
            self._end_sweep({"reason": f"fail_fast: {record.name} errored", "fail_fast": record.name})
        detail = ""
        if status == sw.ERROR:
            detail = f": {error}"
        elif status == sw.TERMINATED:
            row = self._last_row(record) or {}
            if self.metric in row:
                detail = f" ({self.metric}={row[self.metric]})"
            if record.stopped_early:
                detail += f", stopped early by {record.stopped_early}"
        self._say("%s %s%s; %s", record.name, status, detail, self._progress())

    def _progress(self) -> str:
        """"3/10 done, 2 running, 5 pending, ETA 00:04:10": where the sweep stands, and the
        time left at the pace of the trials this driver saw end."""
        counts = self.manifest.counts()
        done = sum(n for status, n in counts.items() if status in sw.DONE)
        return sweep_progress(done, counts.get(sw.RUNNING, 0), self.total, time.monotonic() - self._t0,
                              done - self._done_at_start)

    def _collect(self, running: Running, stopping: bool) -> None:
        """A trial process ended: record what became of the trial."""
        record, outcome = running.record, running.message
        paused = self.population is not None and self.population.pending(record.name) is not None
        if paused and not stopping:  # it paused, whatever became of its driver after that
            record.status, record.ended_at = sw.PAUSED, time.time()
            self.save()
            self._say("%s paused (%s); %s", record.name, type(self.scheduler).__name__, self._progress())
        elif isinstance(outcome, TrialDone):
            self._ended(record, sw.TERMINATED)
        elif isinstance(outcome, TrialInterrupted):
            self._ended(record, sw.INTERRUPTED)
        elif isinstance(outcome, TrialFailed):
            if stopping and outcome.kind == "KeyboardInterrupt":
                self._ended(record, sw.INTERRUPTED)
            else:
                self._ended(record, sw.ERROR, outcome.summary)
        elif stopping:
            self._ended(record, sw.INTERRUPTED)
        elif not running.taken:  # a kept process died before it took the trial: nothing began
            record.status = sw.PENDING
            self.queue.insert(0, record.name)
            self.save()
        elif record.relaunches < MAX_RELAUNCHES and (lost := running.proc.lost()):
            self._relaunch(record, lost, running.proc.relaunch_ready())
        else:
            self._ended(record, sw.ERROR, running.proc.died())

    def _relaunch(self, record: TrialRecord, lost: str, ready: Callable[[], bool]) -> None:
        """A trial's driver was lost with its node: the trial runs again first, from its last
        committed checkpoint (its run's lease, held by the lost driver, is taken over), once
        `ready` says the lost node cannot be chosen again."""
        record.relaunches += 1
        record.status, record.driver = sw.PENDING, None
        self.queue.insert(0, record.name)
        self.relaunching[record.name] = ready
        self.save()
        log.warning("sweep %s: the driver of %s was lost (%s); the trial runs again from its last "
                    "checkpoint (relaunch %d)", self.name, record.name, lost, record.relaunches)

    def execute(self) -> None:
        """Run the queued and newly proposed trials; raise TrainingInterruptedError on a signal."""
        running = RunningTrials(self._placed, self.gpus.give if self.gpus is not None else lambda gpus: None)
        self._t0, self._spent_before = time.monotonic(), self.manifest.running_s
        self._done_at_start = sum(1 for t in self.manifest.trials if t.status in sw.DONE)
        with Interrupts() as interrupts:
            try:
                forwarded = self._run_trials(running, interrupts)
                running.close_idle()
            except BaseException:
                running.kill_all()
                raise
        if self.events is not None:
            self.events.finished()
        if forwarded:
            self._interrupted(interrupts.signal_name or "a signal")
        self._finish()
        failed = (self.manifest.stopped or {}).get("fail_fast")
        if failed and fail_fast(self.trainable, self.run_config) == "raise":
            record = self.manifest.trial(failed)
            raise TrainingFailedError(f"sweep {self.storage.url()!r} ended at the first failed trial "
                                      f"(fail_fast='raise'): {failed}: {record.error if record else ''}")

    def _run_trials(self, running: RunningTrials, interrupts: Interrupts) -> int:
        """The driver's loop: beat the lease, forward new signals, start trials while none was
        forwarded, wait, and record the trials whose processes ended; until no trial runs and
        none is left to start. Each pass is a step of the sweep callbacks. Returns how many
        signals were forwarded (0: none came)."""
        forwarded, done = 0, False
        while not done:
            if self.events is not None:
                self.events.step_begin()
            self.lease.beat()
            self._watch()
            if interrupts.count > forwarded:
                forwarded = interrupts.count
                running.forward(interrupts.signal_name, self.name)
            if not forwarded:
                self._start_trials(running)
            done = not running and bool(forwarded or not self.relaunching)
            for ended in [] if done else running.reap(running.wait(interrupts)):
                self._collect(ended, stopping=bool(forwarded))
            if self.events is not None:
                self.events.step_end()
        return forwarded

    def _watch(self) -> None:
        """Give the sweep callbacks the trials' new results, and end the sweep when its
        stopper's stop_all() or its time budget says so: recorded, and marked for the running
        trials, which stop at their next report (see sweep_stop)."""
        if self.events is None:
            return
        reason = self.events.tick()
        if self.events.unsaved:
            self.events.unsaved = False
            self.save()
        if reason is not None and self.manifest.stopped is None:
            self._end_sweep({"reason": reason})

    def _end_sweep(self, why: dict[str, Any]) -> None:
        """Record that the sweep ends, and mark it for the running trials (see sweep_stop)."""
        self.manifest.stopped = {**why, "at": time.time()}
        mark_stopped(self.storage, why["reason"])
        self.queue.clear()
        self.save()
        self._say("ends: %s; running trials stop at their next report, and no trial starts", why["reason"])

    def _start_trials(self, running: RunningTrials) -> None:
        """Start the next trials until `concurrency` run or none is left (a trial whose trainer
        cannot be built is recorded as ERROR and not counted)."""
        if self.manifest.stopped is not None:
            return
        self._release_paused()
        while len(running) < self.concurrency:
            if self.gpus is not None and not self.gpus.trials and not running.idle():
                return  # again once a trial ends and gives its GPUs back
            share = self._share(running)
            if share == 0:
                return  # no room on the cluster now: again once a trial ends or shrinks
            record = self._next()
            if record is None:
                return
            started = self._launch(record, running, share)
            if started is not None:
                running.add(started)
                self._say("%s started with %s; %s", record.name, record.config, self._progress())

    def _release_paused(self) -> None:
        """Decide for the paused trials (population-based training, HyperBand) that can be (see
        `ready`), and queue those that go on to run again, first (see `population`, `hyperband`).
        Again while a decision ends trials: the ones they were waiting for may be ready then."""
        while self.population is not None and len(self.manifest.trials) >= self.total:
            paused = [r for r in self.manifest.trials if r.status == sw.PAUSED]
            unfinished = [r.name for r in self.manifest.trials if r.status not in sw.DONE]
            ready = [r for r in paused if self.population.ready(r.name, unfinished)]
            if not ready:
                return
            for record in reversed(ready):
                self._apply(record)
            self.save()

    def _apply(self, record: TrialRecord) -> None:
        """Decide for a paused trial (or apply the decision made before): it stops, or it is
        queued first to run on (with an exploit's new config)."""
        decision = self.population.decide(record.name) if self.population.pending(record.name) else {}
        if decision.get("action") == "stop":  # HyperBand: not among the best of its rung
            record.stopped_early = decision["why"]
            self._ended(record, sw.TERMINATED)
            return
        record.status, record.config = sw.PENDING, ss.spec(self._config_of(record.name))
        record.overrides = self.population.overrides(record.name) or None
        self.queue = [record.name] + [name for name in self.queue if name != record.name]
        if decision.get("action") == "exploit":
            self._say("%s exploits %s (%s) and continues with %s", record.name, decision["donor"],
                      decision["checkpoint"], decision["overrides"])

    def _share(self, running: RunningTrials) -> int | None:
        """On a Ray cluster, the most workers the next trial may start with beside what the
        running ones hold now (0: none fits now; see `trial_slots`); None on the local engine."""
        if self.slots is None:
            return None
        trials = running.values()
        held = [holding(self.storage.child(r.record.name), self.slots.most) for r in trials]
        return self.slots.share([r.share if h is None else h for r, h in zip(trials, held, strict=True)])

    def _finish(self) -> None:
        """Record the sweep as FINISHED when every trial is done, else INCOMPLETE, and log the counts."""
        trials = self.manifest.trials
        done = self.manifest.stopped is not None or (
            all(t.status in sw.DONE for t in trials) and len(trials) >= self.total)
        self.manifest.status = sw.SWEEP_FINISHED if done else sw.SWEEP_INCOMPLETE
        self.save()
        counts = self.manifest.counts()
        self._say("%s: %s", self.manifest.status, ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))

    def _placed(self, record: TrialRecord, message: TrialPlaced) -> None:
        """Where a trial's driver was placed (a Ray cluster): recorded, for a relaunch."""
        record.driver = {"node_id": message.node_id, "address": message.address, "pid": message.pid}
        self.save()

    def _interrupted(self, signal_name: str) -> None:
        self.manifest.status = sw.SWEEP_INTERRUPTED
        self.save()
        counts = self.manifest.counts()
        unfinished = (sum(counts.get(s, 0) for s in sw.UNFINISHED)
                      + max(0, self.total - len(self.manifest.trials)))
        path = self.storage.url()
        raise TrainingInterruptedError(
            f"sweep {path!r} was interrupted by {signal_name}: {counts.get(sw.TERMINATED, 0)} trial(s) "
            f"finished, {counts.get(sw.ERROR, 0)} errored, {unfinished} unfinished; every running trial "
            f"checkpointed and stopped.\nContinue it with Tuner.restore({path!r}, trainable).fit(), or by "
            "running the same script again with the same RunConfig(name=..., storage_path=...)")
