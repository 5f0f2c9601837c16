"""Population-based training (tune.schedulers.PopulationBasedTraining): weak trials take over a
strong trial's checkpoint and change their hyperparameters; the decisions are recorded before
they are applied, so a sweep driver killed at any moment resumes to the same population.
Every trial is a real run driven by its own process."""

import ast
import json
import os
import random
import subprocess
import sys

import pytest

from conftest import run_script, start_script, sweep_json
from tune_loops import pbt_loop
from unbroken import tune
from unbroken.store import history
from unbroken.store.storage import Storage
from unbroken.train import DataParallelTrainer, RunConfig
from unbroken.tune import TuneConfig, Tuner
from unbroken.tune import pbt as pbt_mod
from unbroken.tune import search_space as ss
from unbroken.tune.schedulers import PopulationBasedTraining

DRIVER = """
import sys
from tune_loops import pbt_loop
from unbroken import tune
from unbroken import tune
from unbroken.store import history
from unbroken.store.storage import Storage
from unbroken.train import DataParallelTrainer, RunConfig
from unbroken.tune.schedulers import PopulationBasedTraining
pbt = PopulationBasedTraining(perturbation_interval=2, quantile_fraction=0.25, resample_probability=0.25,
                              hyperparam_mutations={"lr": [0.1, 0.2, 0.3, 0.4, 0.5]}, synch=True)
grid = tune.Tuner(pbt_loop, param_space={"lr": tune.grid_search([0.1, 0.2, 0.3, 0.4]), "iterations": 8,
                                        "echo": len(sys.argv) > 3},
                  tune_config=tune.TuneConfig(metric="score", mode="max", scheduler=pbt, seed=3),
                  run_config=RunConfig(name=sys.argv[2], storage_path=sys.argv[1])).fit()
print("DONE", [(r.config["lr"], r.metrics["score"], r.metrics["step"]) for r in grid])
"""


def outcome(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("DONE"))


def lineage(path: str, trial: str) -> list[dict]:
    rel = os.path.join(path, trial, ".unbroken", "pbt.json")
    return json.load(open(rel)) if os.path.exists(rel) else []


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    storage = str(tmp_path_factory.mktemp("pbt"))
    out = run_script(DRIVER, storage, "reference")
    return storage, outcome(out.stdout)


def test_weak_trials_take_over_a_strong_checkpoint_and_change_their_hyperparameters(reference):
    storage, done = reference
    path = os.path.join(storage, "reference")
    trials = sweep_json(path)["trials"]
    assert [t["status"] for t in trials] == ["TERMINATED"] * 4
    exploits = {t["name"]: lineage(path, t["name"]) for t in trials}
    assert exploits["trial_00003"] == [], "the best trial is never the one that exploits"
    first = exploits["trial_00000"][0]  # lr 0.1: the weakest at the first point, step 2
    assert first["round"] == 1 and first["t"] == 2 and first["donor"] == "trial_00003"
    assert first["checkpoint"] == "checkpoint_000002" and first["old_config"]["lr"] == 0.1
    assert first["new_config"]["lr"] in (0.3, 0.4, 0.5), "the donor's lr (0.4), explored"
    rows = [json.loads(line) for line in open(os.path.join(path, "trial_00000", "result.json"))]
    resumed = [r for r in rows if r["attempt"] == 2]
    assert resumed[0]["training_iteration"] == 3, "resumed from the donor's checkpoint of step 2"
    assert resumed[0]["score"] == pytest.approx(0.8 + first["new_config"]["lr"]), "the donor's weight, new lr"
    shown = subprocess.run([sys.executable, "-m", "unbroken", "show", os.path.join(path, "trial_00000")],
                           capture_output=True, text=True, check=True).stdout
    assert "lineage (population-based training)" in shown
    assert (f"round 1 at 2: took trial_00003/checkpoint_000002 (score 0.8 against its 0.2), then "
            f'{{"lr": {first["new_config"]["lr"]}}}') in shown
    final = ast.literal_eval(done[len("DONE "):])
    assert all(step == 8 for _, _, step in final)
    assert final[0][0] == exploits["trial_00000"][-1]["new_config"]["lr"], "the config it ended with"
    for trial, (lr, _, _) in zip(sorted(exploits), final, strict=True):
        if exploits[trial] and exploits[trial][-1]["t"] == 8:
            continue  # exploited at its last step: it took the checkpoint and config, with no step left
        last = json.loads(open(os.path.join(path, trial, "result.json")).read().splitlines()[-1])
        assert last["lr"] == lr, "the config a trial ended with is the one it trained with last"
    assert max(score for _, score, _ in final) >= 0.4 * 8 - 1e-9


@pytest.mark.parametrize("fault", [
    pytest.param("pbt_decided:1:kill", marks=pytest.mark.slow), "pbt_cloned:1:kill",
    pytest.param("pbt_decided:3:kill", marks=pytest.mark.slow)])
def test_a_sweep_driver_killed_while_it_applies_a_decision_resumes_to_the_same_population(
        reference, tmp_path, fault):
    storage, done = reference
    killed = run_script(DRIVER, str(tmp_path), "killed", check=False, UNBROKEN_FAULT=fault)
    assert killed.returncode == -9, killed.stderr
    restored = run_script(DRIVER, str(tmp_path), "killed")
    assert outcome(restored.stdout) == done
    path = os.path.join(str(tmp_path), "killed")
    ref = os.path.join(storage, "reference")
    for trial in (f"trial_{i:05d}" for i in range(4)):
        assert lineage(path, trial) == lineage(ref, trial), trial
        rows = [json.loads(line) for line in open(os.path.join(path, trial, "result.json"))]
        assert sorted({r["training_iteration"] for r in rows}) == list(range(1, 9))


def test_quantiles_and_explore_follow_ray_s_rules():
    scores = {"a": 1.0, "b": 4.0, "c": 2.0, "d": 3.0, "e": 0.5}
    assert pbt_mod.quantiles(scores, 0.25, "max") == (["e", "a"], ["d", "b"])
    assert pbt_mod.quantiles(scores, 0.25, "min") == (["b", "d"], ["a", "e"])
    assert pbt_mod.quantiles({"a": 1.0}, 0.5, "max") == ([], [])
    mutations = {"lr": ss.Float(1e-3, 1.0), "opt": {"m": [0.8, 0.9, 0.99]}}
    sched = PopulationBasedTraining(hyperparam_mutations=mutations, resample_probability=0.0)
    old = {"lr": 0.1, "opt": {"m": 0.9}, "other": 1}
    new = pbt_mod.explore(old, sched, random.Random(0))
    assert new["lr"] in (pytest.approx(0.12), pytest.approx(0.08)) and new["opt"]["m"] in (0.8, 0.99)
    assert new["other"] == 1
    assert pbt_mod.differences(old, new) == {"lr": new["lr"], "opt/m": new["opt"]["m"]}
    with pytest.raises(ValueError, match="needs hyperparam_mutations"):
        PopulationBasedTraining()
    with pytest.raises(ValueError, match="must be a list, a search domain"):
        PopulationBasedTraining(hyperparam_mutations={"lr": 0.1})


def test_pbt_needs_a_metric_and_a_mode(tmp_path):
    sched = PopulationBasedTraining(hyperparam_mutations={"lr": [0.1, 0.2]})
    with pytest.raises(ValueError, match="PopulationBasedTraining needs a metric and a mode"):
        Tuner(pbt_loop, param_space={"lr": 0.1}, tune_config=TuneConfig(scheduler=sched),
              run_config=RunConfig(name="x", storage_path=str(tmp_path)))


SLOW = pytest.mark.slow


@pytest.mark.parametrize("seed", [7, pytest.param(8, marks=SLOW), pytest.param(9, marks=SLOW)])
def test_a_pbt_sweep_killed_at_random_moments_ends_like_the_uninterrupted_one(reference, tmp_path, seed):
    """SIGKILL the sweep driver after a random number of reported rows, again and again,
    restoring each time by running the same script, until the sweep finishes."""
    storage, done = reference
    rng, kills = random.Random(seed), 0
    while True:
        driver = start_script(DRIVER, str(tmp_path), "random", "echo")
        target, seen, finished = rng.randint(1, 12), 0, None
        for line in driver.stdout:
            seen += "REPORTED" in line
            finished = line if line.startswith("DONE") else finished
            if seen >= target and finished is None:
                break
        if finished is not None:
            driver.wait()
            break
        driver.kill()
        driver.wait()
        driver.stdout.close()
        driver.stderr.close()
        kills += 1
        assert kills < 30, "the sweep makes progress across kills"
    assert kills >= 2 and finished.strip() == done
    path, ref = os.path.join(str(tmp_path), "random"), os.path.join(storage, "reference")
    for trial in (f"trial_{i:05d}" for i in range(4)):
        got = [{**e, "old_config": e["old_config"]["lr"], "new_config": e["new_config"]["lr"]}
               for e in lineage(path, trial)]  # its configs also hold `echo`
        want = [{**e, "old_config": e["old_config"]["lr"], "new_config": e["new_config"]["lr"]}
                for e in lineage(ref, trial)]
        assert got == want, trial


def test_asynchronous_pbt_of_a_trainer_decides_as_each_trial_pauses(tmp_path):
    # A Trainer trainable: its hyperparameters are under train_loop_config, and so are the
    # mutations. Without synch each trial is decided for at its own pause, from the latest
    # score of every trial; each trial's history still holds every iteration once.
    sched = PopulationBasedTraining(perturbation_interval=2, quantile_fraction=0.5, resample_probability=0.0,
                                    hyperparam_mutations={"train_loop_config": {"lr": [0.1, 0.2, 0.4, 0.8]}})
    trainer = DataParallelTrainer(pbt_loop, train_loop_config={"lr": 0.1, "iterations": 6})
    grid = Tuner(trainer, param_space={"train_loop_config": {"lr": tune.grid_search([0.1, 0.4])}},
                 tune_config=TuneConfig(metric="score", mode="max", scheduler=sched, seed=1),
                 run_config=RunConfig(name="async", storage_path=str(tmp_path))).fit()
    assert [r.trial_status for r in grid] == ["TERMINATED", "TERMINATED"] and grid.num_errors == 0
    path = os.path.join(str(tmp_path), "async")
    exploits = lineage(path, "trial_00000")
    assert exploits and exploits[0]["donor"] == "trial_00001" and exploits[0]["t"] == 2
    assert exploits[0]["new_config"]["train_loop_config"]["lr"] in (0.2, 0.8), "0.4, moved one place"
    for e in exploits + lineage(path, "trial_00001"):
        assert e["donor_score"] > e["score"], "a trial exploits only one that scored better"
    for result in grid:
        rows = history.timeline(history.read_rows(Storage.from_url(result.path)))
        assert [r["training_iteration"] for r in rows] == list(range(1, 7))
    assert grid[0].config["train_loop_config"]["lr"] == grid[0].metrics["lr"] or exploits[-1]["t"] == 6


def test_a_trial_restarted_from_scratch_forgets_its_pauses_and_decisions(tmp_path):
    from unbroken.tune.population import PBT_DIR, Population, state

    sched = PopulationBasedTraining(perturbation_interval=2, hyperparam_mutations={"lr": [0.1, 0.2]})
    storage = Storage.from_url(str(tmp_path))
    for rel in ("rounds/trial_00001-0001.json", "rounds/trial_00011-0001.json",
                "decisions/trial_00001-0001.json", "paused/trial_00001.json", "state/trial_00001.json"):
        storage.makedirs(f"{PBT_DIR}/{rel.split('/')[0]}")
        storage.write_json(f"{PBT_DIR}/{rel}", {"round": 1, "next": 4, "overrides": {"lr": 0.2}})
    Population(storage, sched, "score", "max", 0, lambda name, with_overrides: {}).forget("trial_00001")
    assert storage.walk_files(PBT_DIR) == ["rounds/trial_00011-0001.json"], "another trial's stays"
    assert state(storage, "trial_00001", sched) == {"round": 0, "next": 2, "overrides": {}}


FINISHED_AT_A_POINT = """
import sys
from tune_loops import pbt_loop
from unbroken import tune
from unbroken.train import RunConfig
from unbroken.tune.schedulers import PopulationBasedTraining
pbt = PopulationBasedTraining(perturbation_interval=2, hyperparam_mutations={"lr": [0.1, 0.2]})
tuner = tune.Tuner(pbt_loop, param_space={"lr": 0.1, "iterations": 8},
                   tune_config=tune.TuneConfig(metric="score", mode="max", scheduler=pbt),
                   run_config=RunConfig(name="finished", storage_path=sys.argv[1],
                                        stop={"training_iteration": 4}))
if sys.argv[2] == "restore":
    tuner = tune.Tuner.restore(sys.argv[1] + "/finished", trainable=pbt_loop)
grid = tuner.fit()
print("DONE", [(r.metrics["step"], r.metrics["training_iteration"]) for r in grid])
"""


def test_a_trial_that_finished_at_its_own_stop_on_a_perturbation_point_is_not_run_again(tmp_path):
    # Its run ends FINISHED at stop=4, a perturbation point; the sweep driver is killed before it
    # records the trial. The restore must see a finished trial, not a PBT pause to decide and
    # run past its stop (the uninterrupted sweep ends at 4).
    killed = run_script(FINISHED_AT_A_POINT, str(tmp_path), "fit", check=False,
                        UNBROKEN_FAULT="before_trial_record:1:kill")
    assert killed.returncode == -9, killed.stderr
    restored = run_script(FINISHED_AT_A_POINT, str(tmp_path), "restore")
    assert outcome(restored.stdout) == "DONE [(4, 4)]", restored.stdout
    rows = [json.loads(line) for line in open(os.path.join(str(tmp_path), "finished", "trial_00000",
                                                           "result.json"))]
    assert [r["training_iteration"] for r in rows] == [1, 2, 3, 4]
    assert sweep_json(os.path.join(str(tmp_path), "finished"))["trials"][0]["status"] == "TERMINATED"
