"""Sweep callbacks' state and the hooks beyond results, as Ray Tune has them: get_state() is
saved with the marks of what the callbacks were told, set_state() gives it back to a restored
sweep's callbacks, and on_checkpoint/on_trial_save, on_trial_restore, on_trial_recover and
the step hooks are each called as often across a killed sweep driver as without the kill."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from conftest import fifo, kill_and_reap, read_until, run_script, start_script, sweep_json
from tune_loops import BLOCK_ENV, tune_loop
from unbroken import tune
from unbroken.errors import PickleRefusedError, SweepMismatchError, UnsavableArgumentError
from unbroken.train import RunConfig

SWEEP = """
import json, os, sys
from tune_loops import tune_loop
from unbroken import tune
from unbroken.train import FailureConfig, RunConfig

class Counts(tune.Callback):
    '''Keeps what it is told in its state (plain data, saved as JSON).'''
    def __init__(self):
        self.seen = {k: [] for k in ("start", "result", "checkpoint", "save", "restore", "recover", "end")}
        self.steps = [0, 0, 0]  # on_step_begin calls, on_step_end calls, the last iteration it gave
    def _add(self, kind, *what):
        self.seen[kind].append(list(what))
    def on_step_begin(self, iteration, trials, **info):
        self.steps[0] += 1
    def on_step_end(self, iteration, trials, **info):
        self.steps[1:] = [self.steps[1] + 1, iteration]
    def on_trial_start(self, iteration, trials, trial, **info):
        self._add("start", trial.trial_name)
    def on_trial_result(self, iteration, trials, trial, result, **info):
        self._add("result", trial.trial_name, result["training_iteration"])
    def on_checkpoint(self, iteration, trials, trial, checkpoint, **info):
        self._add("checkpoint", trial.trial_name, os.path.basename(checkpoint.path))
    def on_trial_save(self, iteration, trials, trial, **info):
        self._add("save", trial.trial_name)
    def on_trial_restore(self, iteration, trials, trial, **info):
        self._add("restore", trial.trial_name, trial.last_result.get("training_iteration"))
    def on_trial_recover(self, iteration, trials, trial, **info):
        self._add("recover", trial.trial_name)
    def on_trial_complete(self, iteration, trials, trial, **info):
        self._add("end", trial.trial_name, trial.status)
    def on_experiment_end(self, trials, **info):
        print("COUNTS", json.dumps(self.seen), flush=True)
        print("STEPS", json.dumps(self.steps), flush=True)
    def get_state(self):
        return self.seen
    def set_state(self, state):
        self.seen = state

class Names(tune.Callback):
    '''Keeps a set (not JSON: its state is pickled).'''
    def __init__(self):
        self.names = set()
    def on_trial_start(self, iteration, trials, trial, **info):
        self.names.add(trial.trial_name)
    def on_experiment_end(self, trials, **info):
        print("NAMES", json.dumps(sorted(self.names)), flush=True)
    def get_state(self):
        return {"names": self.names}
    def set_state(self, state):
        self.names = state["names"]

storage, name, marker, mode = sys.argv[1:5]
rc = RunConfig(name=name, storage_path=storage, verbose=0, failure_config=FailureConfig(max_failures=1),
               callbacks=[Counts(), Names()])
if mode == "restore":
    tuner = tune.Tuner.restore(os.path.join(storage, name), tune_loop, run_config=rc)
else:
    # Trial 0 fails once at iteration 2 (its FailureConfig retries it from checkpoint 1).
    space = {"x": tune.grid_search([1, 2]), "iterations": 4, "fail_once": marker}
    tuner = tune.Tuner(tune_loop, param_space=space, tune_config=tune.TuneConfig(max_concurrent_trials=1),
                       run_config=rc)
tuner.fit()
"""


def printed(out: str, key: str):
    return json.loads(next(line for line in out.splitlines() if line.startswith(key + " "))[len(key) + 1:])


def wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class Other(tune.Callback):
    def get_state(self):
        return {"other": 1}


def killed(storage: str, tmp_path, name: str, told: bool) -> str:
    """Start sweep `name` and SIGKILL its driver while trial 1 blocks after its report 2: at
    once, or (`told`) once the sweep manifest records that report and its checkpoint as told."""
    block = str(tmp_path / f"block-{name}")
    fifo(block, "trial_00001")
    driver = start_script(SWEEP, storage, name, str(tmp_path / f"{name}-failed"), "fit", **{BLOCK_ENV: block})
    read_until(driver, "trial_00001 BLOCKING")
    path = os.path.join(storage, name)

    def recorded() -> bool:
        record = sweep_json(path)["trials"][1]
        return record["results_seen"] == 2 and record["saves_seen"] == [1, 2]

    if told:
        wait_for(recorded, "trial 1's report 2 and checkpoint 2 to be recorded as told")
    kill_and_reap(driver)
    os.remove(os.path.join(block, "trial_00001"))
    return path


def test_callback_state_and_every_hook_survive_a_killed_sweep_driver(storage, tmp_path):
    """The reference sweep runs through; two others have their driver SIGKILLed while trial 1
    blocks after its report 2 (at once, and once that report is recorded as told), and are
    restored with fresh callbacks. Each callback's state goes on from what was saved and ends
    as the reference's: every result, checkpoint and recovery once, plus trial 1's restore."""
    reference = run_script(SWEEP, storage, "reference", str(tmp_path / "ref-failed"), "fit").stdout
    counts = printed(reference, "COUNTS")
    trials = ["trial_00000", "trial_00001"]
    assert counts["result"] == [[t, i] for t in trials for i in range(1, 5)]
    assert counts["checkpoint"] == [[t, f"checkpoint_00000{i}"] for t in trials for i in range(1, 5)]
    assert counts["save"] == [[t] for t in trials for _ in range(4)]
    assert counts["recover"] == [["trial_00000"]] and counts["restore"] == []
    assert counts["end"] == [[t, "TERMINATED"] for t in trials] and counts["start"] == [[t] for t in trials]
    begun, ended, iteration = printed(reference, "STEPS")
    assert begun == ended == iteration > 0, "a pass of the driver's loop is one step"

    path = killed(storage, tmp_path, "told", told=True)
    saved = sweep_json(path)["callback_states"]
    assert [(e["index"], e["class"]) for e in saved] == [(0, "Counts"), (1, "Names")]
    assert saved[0]["state"]["result"][-1] == ["trial_00001", 2], "stored as data, with the marks"
    pickled = os.path.join(path, ".unbroken", "pickled", "callbacks", saved[1]["pickled"] + ".pkl")
    assert os.path.exists(pickled), "a state that is not plain data is pickled beside the manifest"
    with pytest.raises(SweepMismatchError, match=r"a Counts as sweep callback 0.*gives a Other there"):
        tune.Tuner.restore(path, tune_loop, run_config=RunConfig(callbacks=[Other()], verbose=0))
    with pytest.raises(PickleRefusedError, match="saved state of a sweep callback"):
        tune.Tuner.restore(path, tune_loop, run_config=RunConfig(verbose=0), allow_pickle=False)

    for name in ("told", "early"):
        if name == "early":
            killed(storage, tmp_path, name, told=False)
        restored = run_script(SWEEP, storage, name, str(tmp_path / f"{name}-failed"), "restore").stdout
        again = printed(restored, "COUNTS")
        for kind in ("result", "checkpoint", "save", "recover", "end"):
            assert again[kind] == counts[kind], (name, kind)
        assert again["restore"] == [["trial_00001", 2]], "resumed from checkpoint 2, after its result 2"
        assert again["start"][:2] == [[t] for t in trials] and again["start"][-1] == ["trial_00001"]
        assert printed(restored, "NAMES") == trials, "trial 0's start came back with the pickled state"
        assert not any(t["end_due"] for t in sweep_json(os.path.join(storage, name))["trials"])


class Unsavable(tune.Callback):
    def get_state(self):
        return {"lock": threading.Lock()}


def test_a_state_that_can_be_neither_json_nor_pickled_is_refused_before_a_trial_runs(storage):
    tuner = tune.Tuner(tune_loop, param_space={"iterations": 1},
                       run_config=RunConfig(name="unsavable", storage_path=storage, verbose=0,
                                            callbacks=[Unsavable()]))
    with pytest.raises(UnsavableArgumentError, match=r"callback 0 \(Unsavable\).*Hint: return plain data"):
        tuner.fit()
    path = os.path.join(storage, "unsavable")
    assert not any(t["started_at"] for t in sweep_json(path)["trials"])
    assert not os.path.exists(os.path.join(path, "trial_00000"))
