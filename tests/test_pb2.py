"""Population Based Bandits (tune.schedulers.PB2): population-based training whose new
hyperparameters are chosen within bounds by a Gaussian-process bandit fitted to what the
population's records say each config gained. Its decisions are PBT's records, so a sweep
driver killed at any moment resumes to the same population. Every trial is a real run driven
by its own process."""

import ast
import json
import os
import random
import subprocess
import sys

import pytest

from conftest import run_script, sweep_json
from tune_loops import pbt_loop
from unbroken.errors import SearchSpaceError
from unbroken.store.storage import Storage
from unbroken.train import RunConfig
from unbroken.tune import TuneConfig, Tuner, pb2_bandit
from unbroken.tune.pbt import Exploit
from unbroken.tune.population import Population
from unbroken.tune.schedulers import PB2

LOW, HIGH = 0.05, 0.6

DRIVER = f"""
import sys
from tune_loops import pbt_loop
from unbroken import tune
from unbroken.train import RunConfig
from unbroken.tune.schedulers import PB2
if sys.argv[3] == "restore":
    tuner = tune.Tuner.restore(sys.argv[1] + "/" + sys.argv[2], trainable=pbt_loop)
else:
    pb2 = PB2(time_attr="training_iteration", perturbation_interval=2, synch=True,
              hyperparam_bounds={{"lr": [{LOW}, {HIGH}]}})
    space = {{"lr": tune.grid_search([0.1, 0.2, 0.3, 0.4]), "iterations": 6, "echo": True}}
    tuner = tune.Tuner(pbt_loop, param_space=space,
                       tune_config=tune.TuneConfig(metric="score", mode="max", scheduler=pb2, seed=3),
                       run_config=RunConfig(name=sys.argv[2], storage_path=sys.argv[1]))
grid = tuner.fit()
print("DONE", [(r.config["lr"], r.metrics["score"], r.metrics["step"]) for r in grid])
"""
TRIALS = [f"trial_{i:05d}" for i in range(4)]


def outcome(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("DONE"))


def lineage(path: str, trial: str) -> list[dict]:
    rel = os.path.join(path, trial, ".unbroken", "pbt.json")
    return json.load(open(rel)) if os.path.exists(rel) else []


def decisions(path: str) -> dict[str, dict]:
    folder = os.path.join(path, ".unbroken", "pbt", "decisions")
    return {name: json.load(open(os.path.join(folder, name))) for name in sorted(os.listdir(folder))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    storage = str(tmp_path_factory.mktemp("pb2"))
    out = run_script(DRIVER, storage, "reference", "fit")
    return storage, outcome(out.stdout)


def test_weak_trials_exploit_a_strong_one_and_the_bandit_explores_within_the_bounds(reference):
    storage, done = reference
    path = os.path.join(storage, "reference")
    manifest = sweep_json(path)
    assert [t["status"] for t in manifest["trials"]] == ["TERMINATED"] * 4
    assert manifest["scheduler"]["kind"] == "pb2" and manifest["scheduler"]["hyperparam_bounds"] == {
        "lr": [LOW, HIGH]}
    exploits = sorted(({**e, "trial": trial} for trial in TRIALS for e in lineage(path, trial)),
                      key=lambda e: e["round"])
    assert sorted(e["round"] for e in exploits) == [1, 2, 3], "one of four exploits at each point"
    for e in exploits:
        assert e["donor_score"] > e["score"], "a trial exploits only one that scored better"
        assert LOW <= e["new_config"]["lr"] <= HIGH and e["new_config"]["iterations"] == 6
    # From round 2 on there are stretches to learn from: the lr gained is the score gained per
    # step, so the bandit's upper confidence bound is highest near the top of the bounds.
    assert all(e["new_config"]["lr"] > 0.5 for e in exploits if e["round"] >= 2)
    for trial in TRIALS:  # each exploit went on from the donor's weight with the new lr
        rows = [json.loads(line) for line in open(os.path.join(path, trial, "result.json"))]
        for e in lineage(path, trial):
            lr = e["new_config"]["lr"]
            went_on = [r for r in rows if r["training_iteration"] == e["t"] + 1 and r["lr"] == lr]
            assert e["t"] == 6 or went_on[0]["score"] == pytest.approx(e["donor_score"] + lr)
    first = os.path.join(path, exploits[0]["trial"])
    shown = subprocess.run([sys.executable, "-m", "unbroken", "show", first], capture_output=True, text=True,
                           check=True).stdout
    assert "lineage (population-based training)" in shown and exploits[0]["checkpoint"] in shown
    final = ast.literal_eval(done[len("DONE "):])
    assert [step for _, _, step in final] == [6] * 4
    for trial, (lr, _, _) in zip(TRIALS, final, strict=True):
        ended_with = lineage(path, trial)[-1]["new_config"]["lr"] if lineage(path, trial) else None
        assert lr == (ended_with or [0.1, 0.2, 0.3, 0.4][TRIALS.index(trial)])


@pytest.mark.parametrize("fault", [
    "pbt_deciding:5:kill",  # round 1 applied, round 2 not chosen: the bandit chooses it after the restore
    "pbt_decided:6:kill",  # round 2's second decision written, not applied: applied as recorded
])
def test_a_killed_pb2_sweep_restored_ends_like_the_uninterrupted_one(reference, tmp_path, fault):
    storage, done = reference
    path, ref = os.path.join(str(tmp_path), "killed"), os.path.join(storage, "reference")
    killed = run_script(DRIVER, str(tmp_path), "killed", "fit", check=False, UNBROKEN_FAULT=fault)
    assert killed.returncode == -9, killed.stderr
    recorded = sum(d["round"] == 2 for d in decisions(path).values())
    assert recorded == (0 if fault.startswith("pbt_deciding") else 2)
    restored = run_script(DRIVER, str(tmp_path), "killed", "restore")
    assert outcome(restored.stdout) == done
    assert decisions(path) == decisions(ref)
    for trial in TRIALS:
        assert lineage(path, trial) == lineage(ref, trial), trial
        rows = [json.loads(line) for line in open(os.path.join(path, trial, "result.json"))]
        assert sorted({r["training_iteration"] for r in rows}) == list(range(1, 7))


@pytest.mark.parametrize("bounds,message", [
    (None, "PB2 needs hyperparam_bounds"),
    ({}, "PB2 needs hyperparam_bounds"),
    ({"lr": [0.5, 0.1]}, r"hyperparam_bounds\['lr'\] must have low < high"),
    ({"lr": [0.1, 0.1]}, r"hyperparam_bounds\['lr'\] must have low < high"),
    ({"opt": {"lr": [0.1]}}, r"hyperparam_bounds\['opt/lr'\] must be \[low, high\], two numbers"),
    ({"lr": ["a", 1]}, r"must be \[low, high\], two numbers"),
])
def test_bad_bounds_are_refused_at_construction(bounds, message):
    with pytest.raises(SearchSpaceError, match=message) as refused:
        PB2(metric="score", mode="max", hyperparam_bounds=bounds)
    assert "Hint:" in str(refused.value)
    with pytest.raises(ValueError, match="PB2 quantile_fraction must be between 0 and 0.5"):
        PB2(hyperparam_bounds={"lr": [0.1, 0.2]}, quantile_fraction=0.7)


def test_a_bound_the_param_space_does_not_have_is_refused_before_anything_is_written(tmp_path):
    pb2 = PB2(time_attr="training_iteration", perturbation_interval=2, hyperparam_bounds={"momentum": [0, 1]})
    with pytest.raises(SearchSpaceError, match="'momentum'.*Hint:"):
        Tuner(pbt_loop, param_space={"lr": 0.1, "iterations": 2},
              tune_config=TuneConfig(metric="score", mode="max", scheduler=pb2),
              run_config=RunConfig(name="bad", storage_path=str(tmp_path)))
    assert not os.path.exists(os.path.join(str(tmp_path), "bad"))


def test_without_scikit_learn_pb2_says_which_extra_to_install():
    code = ("import sys\nsys.modules['sklearn'] = None\n"
            "from unbroken.errors import MissingDependencyError\n"
            "from unbroken.tune.schedulers.pb2 import PB2\n"
            "try:\n    PB2(hyperparam_bounds={'lr': [0.1, 0.2]})\n"
            "except MissingDependencyError as e:\n    print('REFUSED', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("REFUSED PB2 needs scikit-learn") and "pip install 'unbroken[pb2]'" in out


def test_the_bandit_is_seeded_and_keeps_within_the_bounds_and_ints_whole(tmp_path):
    data = [(float(t), 0.3 * t, [0.1 + 0.05 * t], 0.1 + 0.05 * t) for t in range(8)]
    picks = [pb2_bandit.select(data, (8.0, 2.4), [(LOW, HIGH)], random.Random(1)) for _ in range(2)]
    assert picks[0] == picks[1] and LOW <= picks[0][0] <= HIGH
    assert all(LOW <= v <= HIGH for v in pb2_bandit.select([], (0.0, 0.0), [(LOW, HIGH)], random.Random(2)))
    # No stretch recorded yet: uniform within the bounds; an int stays an int, within them.
    pb2 = PB2(hyperparam_bounds={"layers": [1, 4], "opt": {"lr": [LOW, HIGH]}}, metric="score", mode="max")
    donor = {"layers": 2, "opt": {"lr": 0.1}, "other": "x"}
    population = Population(Storage.from_url(str(tmp_path)), pb2, "score", "max", 0, lambda *_: donor)
    exploit = Exploit("b", "a", 1, 1, donor, {"t": 2, "score": 1.0}, population)
    for seed in range(5):
        new = pb2.new_config(exploit, random.Random(seed))
        assert isinstance(new["layers"], int) and 1 <= new["layers"] <= 4 and new["other"] == "x"
        assert LOW <= new["opt"]["lr"] <= HIGH
    pb2.check_config(donor)
    with pytest.raises(SearchSpaceError, match="holds 'x', not a number"):
        PB2(hyperparam_bounds={"other": [0, 1]}).check_config(donor)
