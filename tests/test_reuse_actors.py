"""`TuneConfig(reuse_actors=True)`: a trial's process and its worker processes, once a trial
ends cleanly (a PBT pause, or its end), run the next trial to start instead of new ones.
What the sweep records is the same as with new processes; a class trainable goes on in its
object through `reset_config` when it resumes from a checkpoint; a kept process that dies
while idle is replaced."""

import ast
import json
import os
from collections import Counter

import pytest

from conftest import run_script, sweep_json
from unbroken.tune import TuneConfig

DRIVER = """
import sys
from tune_loops import Resettable, noted_pbt_loop
from unbroken import tune
from unbroken.train import CheckpointConfig, RunConfig
from unbroken.tune.schedulers import PopulationBasedTraining

kind, reuse = sys.argv[3], sys.argv[4] == "1"
pbt = PopulationBasedTraining(perturbation_interval=2, quantile_fraction=0.25, resample_probability=0.25,
                              hyperparam_mutations={"lr": [0.1, 0.2, 0.3, 0.4, 0.5]}, synch=True)
space = {"lr": tune.grid_search([0.1, 0.2, 0.3, 0.4]), "iterations": 8, "resets": kind != "class-no-reset"}
grid = tune.Tuner(noted_pbt_loop if kind == "function" else Resettable, param_space=space,
                  tune_config=tune.TuneConfig(metric="score", mode="max", scheduler=pbt, seed=3,
                                              max_concurrent_trials=2, reuse_actors=reuse),
                  run_config=RunConfig(name=sys.argv[2], storage_path=sys.argv[1], verbose=0,
                                       stop={"training_iteration": 8},
                                       checkpoint_config=CheckpointConfig(checkpoint_frequency=1))).fit()
print("DONE", [(r.config["lr"], r.metrics["score"], r.metrics["step"]) for r in grid])
"""

TRIALS = [f"trial_{i:05d}" for i in range(4)]


def sweep(storage: str, name: str, kind: str, reuse: bool, **env: str) -> tuple[str, list[tuple[str, int]]]:
    """Run the sweep; its DONE line, and the calls noted, as (call, pid)."""
    log = os.path.join(storage, f"{name}.calls")
    out = run_script(DRIVER, storage, name, kind, "1" if reuse else "0", TUNE_TEST_REUSE_LOG=log, **env)
    done = next(line for line in out.stdout.splitlines() if line.startswith("DONE"))
    calls = [(what, int(pid)) for what, pid, _ in (line.split() for line in open(log))]
    return done, calls


def records(path: str) -> dict[str, tuple]:
    """Each trial's rows (iteration, score, lr, attempt) and lineage: what the sweep recorded."""
    out = {}
    for trial in TRIALS:
        rows = [json.loads(line) for line in open(os.path.join(path, trial, "result.json"))]
        lineage = os.path.join(path, trial, ".unbroken", "pbt.json")
        out[trial] = ([(r["training_iteration"], r["score"], r["lr"], r["attempt"]) for r in rows],
                      json.load(open(lineage)) if os.path.exists(lineage) else [])
    return out


def runs(path: str) -> int:
    """How many runs (fit() calls) the sweep's trials made in all."""
    manifests = (os.path.join(path, t, ".unbroken", "run.json") for t in TRIALS)
    return sum(len(json.load(open(m))["attempts"]) for m in manifests)


@pytest.mark.parametrize("kind", ["function", "class", "class-no-reset"])
def test_reused_processes_run_a_pbt_sweep_as_new_processes_do(tmp_path, kind):
    storage = str(tmp_path)
    fresh, fresh_calls = sweep(storage, "fresh", kind, reuse=False)
    reused, reused_calls = sweep(storage, "reused", kind, reuse=True)
    assert reused == fresh
    assert records(os.path.join(storage, "reused")) == records(os.path.join(storage, "fresh"))
    total = runs(os.path.join(storage, "fresh"))
    assert runs(os.path.join(storage, "reused")) == total > len(TRIALS), "the trials paused and went on"
    fresh_pids = {pid for _, pid in fresh_calls}
    reused_pids = {pid for _, pid in reused_calls}
    assert len(fresh_pids) == total, "without reuse, each run is a new worker process"
    assert len(reused_pids) <= 2, "with reuse, the 2 concurrent trials' worker processes run every run"
    counts = Counter(what for what, _ in reused_calls)
    final = ast.literal_eval(reused[len("DONE "):])
    assert [step for _, _, step in final] == [8] * 4
    if kind == "function":
        assert counts["run"] == total
        return
    resumes = total - len(TRIALS)
    assert counts["load"] == resumes, "every run that resumes loads its checkpoint, reused or not"
    assert counts["cleanup"] == counts["setup"], "every object is cleaned up once, kept or not"
    if kind == "class":
        assert counts["setup"] == len(TRIALS), "a new object only for a trial's first run"
        assert counts["reset"] == resumes, "every resumed run went on in a kept object"
    else:
        assert counts["setup"] == total and counts["reset"] == resumes, "reset_config said no: built anew"
    assert Counter(what for what, _ in fresh_calls)["reset"] == 0


@pytest.mark.parametrize("point", ["trial_process_waits", "kept_worker_waits"])
def test_a_process_kept_for_the_next_trial_that_dies_idle_is_replaced(tmp_path, point):
    storage = str(tmp_path)
    reference, _ = sweep(storage, "fresh", "function", reuse=False)
    struck = os.path.join(storage, "struck.log")
    done, calls = sweep(storage, "killed", "function", reuse=True, UNBROKEN_FAULT=f"{point}:1:kill::once",
                        UNBROKEN_FAULT_LOG=struck)
    assert open(struck).read().split()[0] == point, "the fault struck"
    assert done == reference
    path = os.path.join(storage, "killed")
    assert [t["status"] for t in sweep_json(path)["trials"]] == ["TERMINATED"] * 4
    assert records(path) == records(os.path.join(storage, "fresh"))
    assert 2 < len({pid for _, pid in calls}) < runs(path), "one process was replaced, the others reused"


TRAINER = """
import sys
import torch
import torch.distributed as dist
from unbroken import train, tune
from unbroken.train import RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer

def loop(config):
    import os
    total = torch.tensor([float(config["x"] * (train.get_context().get_world_rank() + 1))])
    dist.all_reduce(total)
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    train.report({"sum": total.item(), "pids": pids})

trainer = TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=2))
grid = tune.Tuner(trainer, param_space={"train_loop_config": {"x": tune.grid_search([1, 2, 3])}},
                  tune_config=tune.TuneConfig(max_concurrent_trials=1, reuse_actors=True),
                  run_config=RunConfig(name="reused", storage_path=sys.argv[1], verbose=0)).fit()
print("DONE", [(r.metrics["sum"], r.metrics["pids"]) for r in grid])
"""


def test_a_trainer_s_worker_group_runs_the_next_trial_in_the_same_processes(tmp_path):
    out = run_script(TRAINER, str(tmp_path))
    done = ast.literal_eval(next(line for line in out.stdout.splitlines() if line.startswith("DONE"))[5:])
    assert [total for total, _ in done] == [3.0, 6.0, 9.0], "each trial's own collective, on its config"
    assert len({tuple(pids) for _, pids in done}) == 1, "the 3 trials ran on the same 2 worker processes"
    assert len(set(done[0][1])) == 2


def test_reuse_actors_must_be_a_bool():
    with pytest.raises(ValueError, match="reuse_actors must be None, True or False"):
        TuneConfig(reuse_actors="yes")


def test_a_restore_may_switch_reuse_and_otherwise_keeps_the_saved_setting():
    from unbroken.store.sweep_manifest import SweepManifest
    from unbroken.tune.saved_sweep import amend_tune_config

    manifest = SweepManifest(name="s", seed=3)
    saved = TuneConfig(seed=3, reuse_actors=True)
    assert amend_tune_config(saved, TuneConfig(), manifest, "s").reuse_actors is True
    assert amend_tune_config(saved, TuneConfig(reuse_actors=False), manifest, "s").reuse_actors is False
