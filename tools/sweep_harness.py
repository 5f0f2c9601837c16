"""Crash harness, sweep mode (`crash_harness.py --sweep`): kill a population-based training
sweep's driver at random moments and check that the sweep ends as if it had never stopped.

Each trial runs a real PBT sweep (4 trials, synchronous PBT with a perturbation point every 2
iterations, every trial stopped by `RunConfig(stop={"training_iteration": 6})`, a point
too, a checkpoint at each report) in a driver process of its own. Each launch of the driver
is one of:
  - SIGKILL the sweep driver after a random number of reported rows;
  - the fault point `before_trial_record` (`unbroken.core.faults`): the sweep driver is
    killed when a trial's process has ended and sweep.json does not say how yet, the n-th
    time for a random n; a trial that finished at its own stop, on a perturbation point,
    then looks like a trial paused there;
  - a trial's commit cut short: a trial process is frozen at `before_rename` of its n-th
    checkpoint (its row recorded and naming the checkpoint, the marker written, the
    directory not renamed into place), then the sweep driver is SIGKILLed, and the trial
    with it. The row's checkpoint never committed, so the trial must redo that row rather
    than the scheduler act on it (pause, judge or stop the trial there without it).
The sweep is then run again by the same script (auto-resume by name) until it prints its
result. With --hyperband, the sweep is a synchronous HyperBand one instead (9 trials in one
bracket, judged at iterations 1 and 3, the best running to 9; no stop of their own): a kill
between a trial's pause and its record, or between rungs, must not change who goes on.
With --reuse, a launch runs with `reuse_actors=True` at random (the uninterrupted sweep
does not), and may kill, once, a trial's process or a worker process kept idle for the next
trial (`trial_process_waits`, `kept_worker_waits`): that launch must end the sweep.
With --class, 4 class trainables (`tune.Trainable`) stopped by a score, with
`checkpoint_at_end=True` and a checkpoint every 3 steps; a launch may also SIGKILL a trial's
rank at `before_attach_staged` (its checkpoint-at-end files staged, the driver not told),
once, and the trial is retried (`max_failures=1`): each trial must still end with the
checkpoint of the report its stop ended it at (the result printed names it).

Invariants checked at the end of each trial:
  - every launch ends by the kill we injected, or finishes the sweep;
  - the sweep's result (each trial's lr, score and step) equals the uninterrupted sweep's;
  - a finished trial never runs again: no trial has a row past where it stopped in the
    uninterrupted sweep, in any attempt;
  - each trial's history has each iteration once, the same ones as uninterrupted (1 to 6);
  - each trial's lineage (its exploits) equals the uninterrupted sweep's;
  - sweep.json says FINISHED, every trial TERMINATED.

Usage:  python tools/sweep_harness.py --trials 10 [--seed N] [--json] [--hyperband | --class]
                                       [--reuse]
Exit status 0 when no invariant was violated, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

STOP_AT = 6
MAX_LAUNCHES = 40

DRIVER = """
import sys
import os
from sweep_harness import pbt_loop
from unbroken import tune
from unbroken.train import CheckpointConfig, FailureConfig, RunConfig


class AtEndTrainable(tune.Trainable):
    # w grows by lr each step; a checkpoint every 3 steps and one at the report its stop ends
    # it at (checkpoint_at_end); prints REPORTED once the previous step's report is sent.

    def setup(self, config):
        self.w = 0.0

    def step(self):
        if self.iteration:
            print("REPORTED", flush=True)
        self.w += self.config["lr"]
        return {"score": self.w, "step": self.iteration + 1}

    def save_checkpoint(self, checkpoint_dir):
        return {"w": self.w}

    def load_checkpoint(self, checkpoint):
        self.w = checkpoint["w"]

    def reset_config(self, new_config):
        return True  # load_checkpoint sets w: a reused object goes on as a new one would


from unbroken.tune.schedulers import HyperBandScheduler, PopulationBasedTraining

if sys.argv[3] == "pbt":
    scheduler = PopulationBasedTraining(
        perturbation_interval=2, quantile_fraction=0.25, resample_probability=0.25,
        hyperparam_mutations={"lr": [0.1, 0.2, 0.3, 0.4, 0.5]}, synch=True)
    space = {"lr": tune.grid_search([0.1, 0.2, 0.3, 0.4]), "iterations": 8}
    stop = {"training_iteration": STOP_AT}
    checkpoints, failures = CheckpointConfig(), FailureConfig()
elif sys.argv[3] == "hyperband":  # synchronous HyperBand: one bracket of 9 trials judged at 1 and 3
    scheduler = HyperBandScheduler(max_t=9, reduction_factor=3)
    space = {"lr": tune.grid_search([0.5, 0.1, 0.4, 0.2, 0.9, 0.3, 0.7, 0.6, 0.8]), "iterations": 20}
    stop = None
    checkpoints, failures = CheckpointConfig(), FailureConfig()
else:  # class trainables stopped by a score, each with its checkpoint_at_end; a rank killed is retried
    scheduler = None
    space = {"lr": tune.grid_search([0.5, 1.0, 1.5, 2.0]), "iterations": 20}
    stop = {"score": STOP_AT}
    checkpoints = CheckpointConfig(checkpoint_frequency=3, checkpoint_at_end=True)
    failures = FailureConfig(max_failures=1)
grid = tune.Tuner(pbt_loop if sys.argv[3] != "class" else AtEndTrainable, param_space=space,
                  tune_config=tune.TuneConfig(metric="score", mode="max", scheduler=scheduler, seed=3,
                                              max_concurrent_trials=2, reuse_actors=sys.argv[4] == "1"),
                  run_config=RunConfig(name=sys.argv[2], storage_path=sys.argv[1], verbose=0, stop=stop,
                                       failure_config=failures, checkpoint_config=checkpoints)).fit()
print("DONE", [(r.config["lr"], round(r.metrics["score"], 9), r.metrics["step"],
                r.checkpoint and os.path.basename(r.checkpoint.path.rstrip("/"))) for r in grid], flush=True)
""".replace("STOP_AT", str(STOP_AT))


def pbt_loop(config: dict) -> None:
    """w grows by lr each step (from the checkpoint it resumes, its own or a donor's); a
    checkpoint at every report; prints REPORTED after each, for the harness to count."""
    import tempfile as tmp

    from unbroken import tune
    from unbroken.train import Checkpoint

    step, w = 0, 0.0
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d, open(os.path.join(d, "state.json")) as f:
            saved = json.load(f)
        step, w = saved["step"], saved["w"]
    for it in range(step + 1, config["iterations"] + 1):
        w += config["lr"]
        with tmp.TemporaryDirectory() as d:
            with open(os.path.join(d, "state.json"), "w") as f:
                json.dump({"step": it, "w": w}, f)
            tune.report({"score": w, "step": it}, checkpoint=Checkpoint.from_directory(d))
        print("REPORTED", flush=True)


def _env(fault: str | None = None, log: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([here, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("UNBROKEN_FAULT", None)
    env.pop("UNBROKEN_FAULT_LOG", None)
    if fault:
        env["UNBROKEN_FAULT"] = fault
    if log:
        env["UNBROKEN_FAULT_LOG"] = log
    return env


def _done(out: str) -> str | None:
    return next((line for line in out.splitlines() if line.startswith("DONE")), None)


def _lineage(path: str, trial: str) -> list[dict[str, Any]]:
    rel = os.path.join(path, trial, ".unbroken", "pbt.json")
    return json.load(open(rel)) if os.path.exists(rel) else []


def _rows(path: str, trial: str) -> list[dict[str, Any]]:
    rel = os.path.join(path, trial, "result.json")
    return [json.loads(line) for line in open(rel) if line.strip()] if os.path.exists(rel) else []


class SweepHarness:
    def __init__(self, seed: int, workdir: str, scheduler: str = "pbt", reuse: bool = False) -> None:
        self.rng = random.Random(seed)
        self.workdir = workdir
        self.scheduler = scheduler  # "pbt", "hyperband" or "class"
        self.reuse = reuse  # launches run with reuse_actors=True at random
        self.iterations: dict[str, list[int]] = {}  # each trial's kept iterations, uninterrupted
        self.counts: Counter[str] = Counter()
        self.violations: list[str] = []
        self.done = ""
        self.lineages: dict[str, list] = {}

    def _command(self, name: str, reuse: bool = False) -> list[str]:
        return [sys.executable, "-u", "-c", DRIVER, self.workdir, name, self.scheduler, "1" if reuse else "0"]

    def reference(self) -> None:
        out = subprocess.run(self._command("reference"), env=_env(), capture_output=True, text=True,
                             timeout=600)
        done = _done(out.stdout)
        if out.returncode != 0 or done is None:
            raise RuntimeError(f"the uninterrupted sweep failed:\n{out.stdout}\n{out.stderr}")
        self.done = done
        path = os.path.join(self.workdir, "reference")
        trials = [t["name"] for t in json.load(open(os.path.join(path, ".unbroken", "sweep.json")))["trials"]]
        self.lineages = {name: _lineage(path, name) for name in trials}
        self.iterations = {name: _timeline(_rows(path, name)) for name in trials}

    def trial(self, index: int) -> None:
        name, where = f"sweep{index}", f"trial {index}"
        path = os.path.join(self.workdir, name)
        for launch in range(MAX_LAUNCHES):
            if self.reuse and self.rng.random() < 0.3:
                out, code, how = self._kill_idle(name, launch)
            elif self.scheduler == "class" and self.rng.random() < 0.3:
                log = os.path.join(self.workdir, f"{name}-{launch}.faults")
                proc = subprocess.run(self._command(name), timeout=600, capture_output=True, text=True,
                                      env=_env("before_attach_staged:1:kill::once", log))
                out, code, how = proc.stdout, proc.returncode, "rank, at-end save"
                self.counts["at-end saves killed"] += os.path.exists(log)
            elif self.rng.random() < 0.25:
                out, code, how = self._kill_inside_a_commit(name, launch, self.rng.randint(1, 2))
            elif self.rng.random() < 0.5:
                fault = f"before_trial_record:{self.rng.randint(1, len(self.iterations))}:kill"
                reuse = self.reuse and self.rng.random() < 0.5
                proc = subprocess.run(self._command(name, reuse), env=_env(fault), capture_output=True,
                                      text=True, timeout=600)
                out, code, how = proc.stdout, proc.returncode, "fault"
            else:
                out, code, how = self._kill_after_reports(name, self.rng.randint(1, 10))
            done = _done(out)
            if done is not None:
                self.counts["trials"] += 1
                self._check_end(path, done, where)
                return
            if code != -9:
                self.violations.append(f"{where}: a launch ended by neither the kill nor the sweep's end "
                                       f"(exit {code})")
                return
            self.counts["restores"] += 1
            self.counts[f"kills ({how})"] += 1
        self.violations.append(f"{where}: no end after {MAX_LAUNCHES} launches")

    def _kill_idle(self, name: str, launch: int) -> tuple[str, int, str]:
        """A launch with reuse_actors=True in which, once, a trial's process or a worker
        process kept for the next trial is SIGKILLed while it waits: the sweep goes on."""
        log = os.path.join(self.workdir, f"{name}-{launch}.idle")
        point = self.rng.choice(["trial_process_waits", "kept_worker_waits"])
        fault = f"{point}:{self.rng.randint(1, 2)}:kill::once"
        proc = subprocess.run(self._command(name, reuse=True), env=_env(fault, log), capture_output=True,
                              text=True, timeout=600)
        self.counts[f"idle {point.split('_')[0]} processes killed"] += os.path.exists(log)
        if _done(proc.stdout) is None:
            self.violations.append(f"{name}: a launch whose {point} fault struck did not end the sweep "
                                   f"(exit {proc.returncode}): {proc.stderr[-2000:]}")
        return proc.stdout, proc.returncode, "idle process"

    def _kill_after_reports(self, name: str, target: int) -> tuple[str, int, str]:
        reuse = self.reuse and self.rng.random() < 0.5
        proc = subprocess.Popen(self._command(name, reuse), env=_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        lines, seen = [], 0
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            seen += "REPORTED" in line
            if seen >= target and not line.startswith("DONE"):
                proc.kill()
                break
        proc.wait()
        proc.stdout.close()
        return "".join(lines), proc.returncode, "after reports"

    def _kill_inside_a_commit(self, name: str, launch: int, n: int) -> tuple[str, int, str]:
        """Freeze the first trial process to reach its `n`-th `before_rename`, then SIGKILL
        the sweep driver (its trials die with it). A sweep that ends first printed DONE."""
        log = os.path.join(self.workdir, f"{name}-{launch}.commit")
        reuse = self.reuse and self.rng.random() < 0.5
        proc = subprocess.Popen(self._command(name, reuse), env=_env(f"before_rename:{n}:stop", log),
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        deadline = time.monotonic() + 300
        while proc.poll() is None and not os.path.exists(log) and time.monotonic() < deadline:
            time.sleep(0.005)  # polls for the frozen commit; the log appears before the freeze
        proc.kill()
        out = proc.communicate()[0]
        if os.path.exists(log):
            self.counts["commits cut short"] += 1
            for line in open(log).read().splitlines():
                try:
                    os.kill(int(line.split()[1]), 9)  # normally gone with the driver already
                except ProcessLookupError:
                    pass
        return out, proc.returncode, "inside a trial's commit"

    def _check_end(self, path: str, done: str, where: str) -> None:
        if done != self.done:
            self.violations.append(f"{where}: the sweep ended with {done}, the uninterrupted one with "
                                   f"{self.done}")
        manifest = json.load(open(os.path.join(path, ".unbroken", "sweep.json")))
        statuses = [t["status"] for t in manifest["trials"]]
        if manifest["status"] != "FINISHED" or set(statuses) != {"TERMINATED"}:
            self.violations.append(f"{where}: sweep.json says {manifest['status']}, trials {statuses}")
        for trial, want in self.lineages.items():
            rows, last = _rows(path, trial), self.iterations[trial][-1]
            past = [r["training_iteration"] for r in rows if r["training_iteration"] > last]
            if past:
                self.violations.append(f"{where}: {trial} ran past where it stopped ({last}): "
                                       f"iterations {past}")
            kept = _timeline(rows)
            if kept != list(range(1, last + 1)) or kept != self.iterations[trial]:
                self.violations.append(f"{where}: {trial}'s history has iterations {kept}")
            if _lineage(path, trial) != want:
                self.violations.append(f"{where}: {trial}'s lineage differs from the uninterrupted sweep's")


def _timeline(rows: list[dict[str, Any]]) -> list[int]:
    from unbroken.store.history import timeline

    return [r["training_iteration"] for r in timeline(rows)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print the counts as one JSON object")
    parser.add_argument("--hyperband", action="store_true",
                        help="a synchronous HyperBand sweep instead of population-based training")
    parser.add_argument("--class", dest="class_", action="store_true",
                        help="class trainables with checkpoint_at_end instead of population-based training")
    parser.add_argument("--reuse", action="store_true",
                        help="launches with reuse_actors=True at random, idle processes killed")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="unbroken-sweep-crash-") as workdir:
        mode = "hyperband" if args.hyperband else "class" if args.class_ else "pbt"
        harness = SweepHarness(seed, workdir, mode, args.reuse)
        harness.reference()
        for i in range(args.trials):
            harness.trial(i)
            if not args.json:
                print(f"\rtrial {i + 1}/{args.trials}, violations: {len(harness.violations)}", end="",
                      flush=True)
    report = {"seed": seed, "seconds": round(time.monotonic() - started, 1),
              **dict(sorted(harness.counts.items())), "violations": harness.violations}
    if args.json:
        print(json.dumps(report))
    else:
        print()
        for key, value in report.items():
            print(f"{key:<24}  {len(value) if key == 'violations' else value}")
    return 1 if harness.violations else 0


if __name__ == "__main__":
    sys.exit(main())
