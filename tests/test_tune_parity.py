"""Ray Tune's everyday names, as a porting user writes them: every search-space function,
stoppers, callbacks, and Tune's stopping and checkpoint semantics."""

from __future__ import annotations

import datetime
import json
import os
import pickle
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import attempts, fifo, kill_and_reap, read_until, run_script, start_script, statuses, sweep_json
from tune_loops import ACTIVE_ENV, BLOCK_ENV, Counter, max_running, tune_loop
from unbroken import tune
from unbroken.errors import SearchSpaceError
from unbroken.train import CheckpointConfig, FailureConfig, RunConfig, TrainingFailedError
from unbroken.tune import search_space as ss
from unbroken.tune import stopper, utils


def test_every_tune_search_space_function_samples_reproducibly_within_its_bounds():
    space = {
        "u": tune.uniform(0, 1), "qu": tune.quniform(0, 10, 2.5), "lu": tune.loguniform(1e-4, 1e-1, base=10),
        "qlu": tune.qloguniform(1e-3, 1, 5e-4), "ri": tune.randint(0, 4), "qri": tune.qrandint(0, 20, 5),
        "lri": tune.lograndint(1, 1000), "qlri": tune.qlograndint(8, 1024, 8), "n": tune.randn(5, 2),
        "qn": tune.qrandn(0, 4, 0.5), "c": tune.choice(["a", "b"]), "g": tune.grid_search([1, 2]),
        # Ray's forms: a function of the spec (the values drawn so far) and one that draws itself.
        "twice": tune.sample_from(lambda spec: spec.config.u * 2 + spec["config"]["g"]),
        "np": tune.sample_from(lambda _: float(np.random.uniform(10, 20))),
    }
    configs = [ss.resolve(space, ss.sample(space, 11, i)) for i in range(40)]
    assert configs == [ss.resolve(space, ss.sample(space, 11, i)) for i in range(40)], "reproducible"
    for c in configs:
        assert 0 <= c["u"] <= 1 and c["qu"] in (0, 2.5, 5, 7.5, 10) and 1e-4 <= c["lu"] <= 1e-1
        assert 0 <= c["ri"] < 4 and c["qri"] % 5 == 0 and 0 <= c["qri"] <= 20
        assert 1 <= c["lri"] < 1000 and c["qlri"] % 8 == 0 and 8 <= c["qlri"] <= 1024
        assert c["qn"] * 2 == int(c["qn"] * 2) and c["c"] in ("a", "b")
        assert c["twice"] == c["u"] * 2 + c["g"]
        assert 10 <= c["np"] <= 20
    assert len({c["np"] for c in configs}) == 40, "each trial draws its own"
    before = np.random.get_state()[1].copy()
    ss.sample(space, 11, 0)
    assert (np.random.get_state()[1] == before).all(), "numpy's global generator is put back"
    # randn's description is what sweeps saved before qrandn existed.
    assert ss.spec({"n": tune.randn()}) == {"n": {"__domain__": "normal", "mean": 0.0, "sd": 1.0}}


def test_a_sample_from_that_returns_what_a_sweep_cannot_record_is_refused_with_a_hint():
    with pytest.raises(SearchSpaceError, match="cannot record.*Hint"):
        ss.sample({"x": tune.sample_from(lambda _: object())}, 1, 0)
    with pytest.raises(SearchSpaceError, match="function"):
        tune.sample_from(3)
    with pytest.raises(SearchSpaceError, match="q must be > 0"):
        tune.qrandn(0, 1, 0)


# -- stoppers -----------------------------------------------------------------------------------

def test_stoppers_decide_as_ray_s_do():
    rows = [{"score": s} for s in (1.0, 2.0, 3.0, 3.0, 3.0, 3.0, 3.0)]
    most = stopper.MaximumIterationStopper(3)
    assert [most("t", r) for r in rows[:3]] == [False, False, True] and not most("u", rows[0])
    plateau = stopper.TrialPlateauStopper("score", std=0.01, num_results=4, grace_period=4)
    assert [plateau("t", r) for r in rows] == [False] * 5 + [True, True], "the last 4 values are equal at 6"
    high = stopper.TrialPlateauStopper("score", num_results=2, grace_period=2, metric_threshold=5, mode="max")
    assert not any(high("t", r) for r in rows), "a plateau below the threshold goes on"
    experiment = stopper.ExperimentPlateauStopper("score", top=3, mode="max", patience=2)
    said = []
    for trial, r in zip("abcabca", rows, strict=True):
        assert not experiment(trial, r), "it decides for the sweep only"
        said.append(experiment.stop_all())
    assert said == [False] * 5 + [True, True], "top 3 equal from row 5, for 2 rows"
    both = stopper.CombinedStopper(stopper.MaximumIterationStopper(2), stopper.FunctionStopper(
        lambda trial_id, result: result["score"] >= 2))
    assert [both("t", r) for r in rows[:2]] == [False, True] and not both.stop_all()
    timeout = stopper.TimeoutStopper(datetime.timedelta(seconds=30))
    assert not timeout.stop_all()
    timeout.resume_clock(29.999)
    copy = pickle.loads(pickle.dumps(timeout))
    assert copy.budget_s == 30
    with pytest.raises(ValueError, match="mode"):
        stopper.TrialPlateauStopper("score", metric_threshold=1)
    with pytest.raises(ValueError, match="positive"):
        stopper.TimeoutStopper(0)
    with pytest.raises(ValueError, match="time_budget_s"):
        tune.TuneConfig(time_budget_s=-1)


STOPPED_SWEEP = """
import sys
from tune_loops import tune_loop
from unbroken import tune
from unbroken.train import CheckpointConfig, RunConfig
from unbroken.tune import stopper, utils

def stop_at_score(trial_id, result):  # Tune's form: called with the trial's id
    return trial_id.endswith("_00002") and result["score"] >= 8

space = {"x": tune.grid_search([1, 2, 3]), "cap": 3, "iterations": 20, "block_it": 5}
combined = stopper.CombinedStopper(
    stopper.TrialPlateauStopper("score", std=0.01, num_results=4, grace_period=4),
    stopper.FunctionStopper(stop_at_score))
grid = tune.Tuner(tune_loop, param_space=space,
                  tune_config=tune.TuneConfig(metric="score", mode="max", max_concurrent_trials=1),
                  run_config=RunConfig(name=sys.argv[2], storage_path=sys.argv[1], stop=combined)).fit()
print("DONE", [(r.trial_name, r.metrics["it"]) for r in grid])
"""


def test_a_stopper_decides_each_trial_at_the_same_row_after_a_killed_driver(storage, tmp_path):
    """TrialPlateauStopper stops each trial when its last 4 scores are equal (iteration 6, the
    cap at 3); trial 2's stop function stops it at score 8 first (iteration 3). The driver is
    SIGKILLed while trial 1 blocks at iteration 5: its restored stopper is rebuilt from the
    trial's rows 1-5, so it stops at 6, not at 9 (4 more rows after the restore)."""
    block = str(tmp_path / "block")
    fifo(block, "trial_00001")
    driver = start_script(STOPPED_SWEEP, storage, "killed", **{BLOCK_ENV: block})
    read_until(driver, "trial_00001 BLOCKING")
    kill_and_reap(driver)
    path = os.path.join(storage, "killed")
    assert statuses(path) == {"trial_00000": "TERMINATED", "trial_00001": "RUNNING", "trial_00002": "PENDING"}
    os.remove(os.path.join(block, "trial_00001"))
    out = run_script(STOPPED_SWEEP, storage, "killed").stdout
    expected = "DONE [('trial_00000', 6), ('trial_00001', 6), ('trial_00002', 3)]"
    assert expected in out, out
    assert expected in run_script(STOPPED_SWEEP, storage, "uninterrupted").stdout
    grid = tune.Tuner.restore(path, tune_loop).get_results()
    for result in grid:
        its = [r["training_iteration"] for r in result.rows]
        assert its == list(range(1, len(its) + 1)), "each iteration once"
    assert attempts(grid[1].path) == ["ABORTED", "FINISHED"]


def test_the_time_budget_ends_the_sweep_and_a_restore_runs_nothing_more(storage):
    """time_budget_s=1.5 with trials of 10 s: trial 0 stops at a report soon after the budget,
    as TERMINATED, trial 1 never starts, and the sweep is FINISHED with the reason recorded."""
    space = {"x": tune.grid_search([1, 2]), "iterations": 200, "step_s": 0.05}
    tuner = tune.Tuner(tune_loop, param_space=space,
                       tune_config=tune.TuneConfig(metric="score", mode="max", max_concurrent_trials=1,
                                                   time_budget_s=1.5),
                       run_config=RunConfig(name="budget", storage_path=storage, verbose=0))
    grid = tuner.fit()
    path = os.path.join(storage, "budget")
    manifest = sweep_json(path)
    assert manifest["status"] == "FINISHED" and manifest["stopped"]["reason"] == "time_budget_s=1.5"
    assert 1.5 <= manifest["running_s"] < 5
    [trial0] = [r for r in grid if r.trial_name == "trial_00000"]
    assert trial0.trial_status == "TERMINATED" and 10 <= trial0.metrics["it"] < 200 * 0.5
    assert statuses(path)["trial_00001"] == "PENDING"
    assert not os.path.exists(os.path.join(path, "trial_00001"))
    again = tune.Tuner.restore(path, tune_loop).fit()
    assert statuses(path)["trial_00001"] == "PENDING", "a restore of an ended sweep runs nothing"
    assert [r.metrics["it"] for r in again if r.metrics] == [trial0.metrics["it"]]


def test_an_experiment_plateau_ends_the_sweep(storage):
    """ExperimentPlateauStopper(top=2): the sweep driver sees trial 0's first two equal scores
    (cap=1) and ends the sweep; trial 0 stops at a report soon after, trial 1 never starts."""
    space = {"x": tune.grid_search([1, 2]), "cap": 1, "iterations": 200, "step_s": 0.02}
    grid = tune.Tuner(tune_loop, param_space=space,
                      tune_config=tune.TuneConfig(metric="score", mode="max", max_concurrent_trials=1),
                      run_config=RunConfig(name="plateau", storage_path=storage, verbose=0,
                                           stop=stopper.ExperimentPlateauStopper("score", top=2))).fit()
    path = os.path.join(storage, "plateau")
    assert sweep_json(path)["stopped"]["reason"] == "ExperimentPlateauStopper.stop_all()"
    assert statuses(path) == {"trial_00000": "TERMINATED", "trial_00001": "PENDING"}
    assert 2 <= grid[0].metrics["it"] < 200


def test_a_stop_function_of_the_trial_id_and_the_result_is_called_as_tune_calls_it(storage):
    def stop(trial_id, result):
        return trial_id.endswith("_00000") and result["it"] >= 2

    grid = tune.Tuner(tune_loop, param_space={"iterations": 5},
                      run_config=RunConfig(name="fn", storage_path=storage, verbose=0, stop=stop)).fit()
    assert grid[0].metrics["it"] == 2 and grid[0].trial_status == "TERMINATED"


# -- Tune's semantics -----------------------------------------------------------------------------

def test_fail_fast_ends_the_sweep_at_the_first_errored_trial(storage):
    """Trial 0 (x=1) raises at iteration 2; trial 1 runs beside it (x=2, 10 s of steps): it
    stops at its next report once trial 0 has errored, as TERMINATED; trial 2 never starts.
    'raise' raises the error from fit(); a restore that reruns errored trials runs the sweep
    on, and then every trial."""
    space = {"x": tune.grid_search([1, 2, 3]), "fail_x": 1, "iterations": 30, "step_s": 0.1}

    def tuner(fail_fast):
        return tune.Tuner(tune_loop, param_space=space,
                          tune_config=tune.TuneConfig(metric="score", mode="max", max_concurrent_trials=2),
                          run_config=RunConfig(name=f"ff-{fail_fast}", storage_path=storage, verbose=0,
                                               failure_config=FailureConfig(fail_fast=fail_fast)))

    grid = tuner(True).fit()
    path = os.path.join(storage, "ff-True")
    assert sweep_json(path)["stopped"]["reason"] == "fail_fast: trial_00000 errored"
    assert sweep_json(path)["status"] == "FINISHED"
    shown = subprocess.run([sys.executable, "-m", "unbroken", "show", path], capture_output=True, text=True,
                           check=True).stdout
    assert "ended" in shown and "fail_fast: trial_00000 errored" in shown, shown
    assert statuses(path) == {"trial_00000": "ERROR", "trial_00001": "TERMINATED", "trial_00002": "PENDING"}
    assert grid.num_errors == 1 and grid[1].metrics["it"] < 30
    again = tune.Tuner.restore(path, tune_loop, resume_errored=True).fit()
    assert sweep_json(path)["stopped"] is None and again.num_errors == 0
    assert [r.metrics["it"] for r in again] == [30, grid[1].metrics["it"], 30]
    with pytest.raises(TrainingFailedError, match="fail_fast='raise'.*trial_00000.*injected failure"):
        tuner("raise").fit()
    with pytest.raises(ValueError, match="fail_fast"):
        FailureConfig(fail_fast="yes")


# -- sweep callbacks --------------------------------------------------------------------------------

CALLBACK_SWEEP = """
import sys
from tune_loops import Recorder, tune_loop
from unbroken import tune
from unbroken.train import RunConfig

class Raising(tune.Callback):
    def on_trial_result(self, iteration, trials, trial, result, **info):
        raise RuntimeError("a broken callback")

space = {"x": tune.grid_search([1, 2, 3]), "fail_x": 2, "block_it": 2}
tune.Tuner(tune_loop, param_space=space, tune_config=tune.TuneConfig(max_concurrent_trials=1),
           run_config=RunConfig(name="cb", storage_path=sys.argv[1],
                                callbacks=[Raising(), Recorder(sys.argv[2])])).fit()
print("DONE", flush=True)
"""


def events(path: str) -> list[list]:
    return [json.loads(line) for line in open(path)]


def test_sweep_callbacks_get_each_result_once_across_a_killed_driver(storage, tmp_path):
    """Trial 0 finishes, trial 1 errors at iteration 2, trial 2 blocks after its report 2 and
    the sweep driver is SIGKILLed; the restored sweep resumes trial 2 at 3. Across both
    drivers each result is delivered once, in order, before its trial's end; a callback
    that raises does not stop the others."""
    block, log = str(tmp_path / "block"), str(tmp_path / "events.jsonl")
    fifo(block, "trial_00002")
    driver = start_script(CALLBACK_SWEEP, storage, log, **{BLOCK_ENV: block})
    read_until(driver, "trial_00002 BLOCKING")
    path = os.path.join(storage, "cb")
    deadline = time.monotonic() + 30
    while sweep_json(path)["trials"][2]["results_seen"] < 2:  # delivered, and recorded as delivered
        assert time.monotonic() < deadline, events(log)
        time.sleep(0.05)
    kill_and_reap(driver)
    os.remove(os.path.join(block, "trial_00002"))
    assert "DONE" in run_script(CALLBACK_SWEEP, storage, log).stdout
    seen = events(log)
    results = [tuple(e[1:3]) for e in seen if e[0] == "result"]
    assert results == [("trial_00000", i) for i in range(1, 5)] + [("trial_00001", 1)] + [
        ("trial_00002", i) for i in range(1, 5)], "each result once, in order"
    assert [e for e in seen if e[0] in ("complete", "error")] == [
        ["complete", "trial_00000", 4], ["error", "trial_00001", True], ["complete", "trial_00002", 4]]
    assert seen[0] == ["setup", 3] and seen[-1] == ["end", ["ERROR", "TERMINATED", "TERMINATED"]]
    assert [e[1] for e in seen if e[0] == "start"] == ["trial_00000", "trial_00001", "trial_00002",
                                                       "trial_00002"], "trial 2 again after the restore"
    assert seen.index(["complete", "trial_00000", 4]) > seen.index(["result", "trial_00000", 4, 4.0])


# -- class trainables and tune.utils ----------------------------------------------------------------

def test_a_step_that_returns_should_checkpoint_saves_with_its_result(storage):
    grid = tune.Tuner(Counter, param_space={"iterations": 6, "ckpt_at": [2, 5]},
                      run_config=RunConfig(name="should", storage_path=storage, verbose=0,
                                           checkpoint_config=CheckpointConfig(checkpoint_at_end=False))).fit()
    saved = [r["training_iteration"] for r in grid[0].rows if r.get("checkpoint_dir_name")]
    assert saved == [2, 5] and grid[0].checkpoint.path.endswith("checkpoint_000005")


def test_tune_utils_helpers_behave_as_ray_s():
    nested = {"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}}
    flat = utils.flatten_dict(nested)
    assert flat == {"a/b": 1, "a/c/d": [1, 2], "e": {}}
    assert utils.flatten_dict(nested, flatten_list=True)["a/c/d/1"] == 2
    assert utils.unflatten_dict({"a/b": 1, "a/c/d": [1, 2]}) == {"a": {"b": 1, "c": {"d": [1, 2]}}}
    assert utils.unflattened_lookup("a/c/d/0", nested) == 1
    assert utils.unflattened_lookup("a/x", nested, default=None) is None
    merged = utils.merge_dicts(nested, {"a": {"c": {"z": 3}}, "new": 1})
    assert merged["a"] == {"b": 1, "c": {"d": [1, 2], "z": 3}} and merged["new"] == 1
    assert "z" not in nested["a"]["c"], "merge_dicts changes neither"
    with pytest.raises(KeyError, match="unknown config parameter"):
        utils.deep_update({"a": 1}, {"b": 2})
    with pytest.raises(ValueError, match="delimiter"):
        utils.flatten_dict({"a/b": 1}, prevent_delimiter=True)
    assert utils.validate_save_restore(Counter, {"x": 1}) and utils.validate_save_restore(Counter, {"x": 2})
    with pytest.raises(TypeError):
        utils.validate_save_restore(dict)


def named_loop(config: dict) -> None:
    tune.report({"name": tune.get_context().get_trial_name(), "lr": config["lr"]})


def test_trial_name_and_dirname_creators_name_trials_and_keep_their_directories_unique(storage):
    tc = tune.TuneConfig(trial_name_creator=lambda t: f"T{int(t.trial_id[-5:])}-lr{t.config['lr']}",
                         trial_dirname_creator=lambda t: f"lr={t.config['lr']}")
    tuner = tune.Tuner(named_loop, param_space={"lr": tune.grid_search([0.1, 0.1, 0.2])}, tune_config=tc,
                       run_config=RunConfig(name="named", storage_path=storage, verbose=0))
    grid = tuner.fit()
    path = os.path.join(storage, "named")
    assert [r.trial_name for r in grid] == ["lr=0.1", "lr=0.1_00001", "lr=0.2"]
    assert [r.metrics["name"] for r in grid] == ["T0-lr0.1", "T1-lr0.1", "T2-lr0.2"]
    assert sorted(n for n in os.listdir(path) if not n.startswith(".")) == [r.trial_name for r in grid]
    again = tune.Tuner.restore(path, named_loop).fit()
    assert [r.trial_name for r in again] == [r.trial_name for r in grid], "recorded, not asked again"
    bad = tune.Tuner(named_loop, param_space={"lr": 0.1},
                     tune_config=tune.TuneConfig(trial_dirname_creator=lambda t: "a/b"),
                     run_config=RunConfig(name="bad", storage_path=storage, verbose=0))
    with pytest.raises(ValueError, match="one path component.*Hint"):
        bad.fit()
    with pytest.raises(ValueError, match="function of the trial"):
        tune.TuneConfig(trial_name_creator="T")


class Opaque:
    def __str__(self) -> str:
        return "<opaque>"


def unjsonable_loop(config: dict) -> dict:
    tune.report({"arr": np.arange(3), "half": np.float32(0.5), "n": np.int64(7), "obj": Opaque(),
                 "nested": {"flag": np.bool_(True), "s": {1, 2}}})
    return {"done_with": Opaque()}


def test_a_trial_records_values_json_cannot_hold_as_tune_does(storage):
    grid = tune.Tuner(unjsonable_loop, param_space={},
                      run_config=RunConfig(name="unjson", storage_path=storage, verbose=0)).fit()
    result = grid[0]
    assert result.trial_status == "TERMINATED" and result.error is None
    first, last = result.rows
    assert (first["arr"], first["half"], first["n"], first["obj"]) == ([0, 1, 2], 0.5, 7, "<opaque>")
    assert first["nested"] == {"flag": True, "s": "{1, 2}"}
    assert result.metrics["done_with"] == "<opaque>"


# -- search algorithms ------------------------------------------------------------------------------

def test_a_concurrency_limiter_runs_at_most_its_limit_and_may_change_on_restore(storage, tmp_path,
                                                                               monkeypatch):
    from unbroken.tune.search import BasicVariantGenerator, ConcurrencyLimiter, OptunaSearch

    active = str(tmp_path / "active")
    monkeypatch.setenv(ACTIVE_ENV, active)
    space = {"x": tune.randint(1, 5), "iterations": 3, "step_s": 0.02}
    limited = ConcurrencyLimiter(BasicVariantGenerator(), max_concurrent=1)
    grid = tune.Tuner(tune_loop, param_space=space,
                      tune_config=tune.TuneConfig(num_samples=3, search_alg=limited, max_concurrent_trials=3),
                      run_config=RunConfig(name="limited", storage_path=storage, verbose=0)).fit()
    assert grid.num_terminated == 3 and max_running(active) == 1
    wider = ConcurrencyLimiter(BasicVariantGenerator(), max_concurrent=2)
    again = tune.Tuner.restore(os.path.join(storage, "limited"), tune_loop,
                               tune_config=tune.TuneConfig(num_samples=4, search_alg=wider)).fit()
    assert again.num_terminated == 4, "the limit is not part of the sweep's identity"
    optuna_grid = tune.Tuner(tune_loop, param_space=space, tune_config=tune.TuneConfig(
        num_samples=3, metric="score", mode="max",
        search_alg=ConcurrencyLimiter(OptunaSearch(), max_concurrent=1)),
        run_config=RunConfig(name="optuna-limited", storage_path=storage, verbose=0)).fit()
    assert optuna_grid.num_terminated == 3
    with pytest.raises(ValueError, match="max_concurrent"):
        ConcurrencyLimiter(BasicVariantGenerator(), max_concurrent=0)


def define_by_run(trial) -> dict:
    trial.suggest_float("x", 0.5, 2.0)
    if trial.suggest_categorical("deep", [True, False]):
        trial.suggest_int("opt/layers", 2, 4)
    return {"iterations": 2}


def test_optuna_define_by_run_and_multi_objective_studies_run_and_resume(storage):
    import optuna

    from unbroken.store.storage import Storage
    from unbroken.tune.search import OptunaSearch
    from unbroken.tune.search.optuna_journal import study_storage

    def tuner(samples):
        return tune.Tuner(tune_loop, param_space={"y": 0.25}, tune_config=tune.TuneConfig(
            num_samples=samples, seed=3, metric="score", mode="max",
            search_alg=OptunaSearch(space=define_by_run)),
            run_config=RunConfig(name="dbr", storage_path=storage, verbose=0))

    grid = tuner(3).fit()
    for r in grid:
        assert set(r.config) >= {"x", "deep", "iterations", "y"} and 0.5 <= r.config["x"] <= 2.0
        assert r.config["iterations"] == 2 and r.metrics["it"] == 2 and r.config["y"] == 0.25
        assert ("opt" in r.config) == r.config["deep"]
        assert not r.config["deep"] or 2 <= r.config["opt"]["layers"] <= 4
        assert r.metrics["score"] == pytest.approx(r.config["x"] * 2 + 0.25)
    more = tune.Tuner.restore(os.path.join(storage, "dbr"), tune_loop,
                              tune_config=tune.TuneConfig(num_samples=5)).fit()
    assert [r.config for r in more][:3] == [r.config for r in grid] and len(more) == 5
    with pytest.raises(SearchSpaceError, match="one of the two"):
        tune.Tuner(tune_loop, param_space={"x": tune.uniform(0, 1)}, tune_config=tune.TuneConfig(
            num_samples=1, search_alg=OptunaSearch(space=define_by_run, metric="score", mode="max")),
            run_config=RunConfig(name="both", storage_path=storage, verbose=0)).fit()

    multi = OptunaSearch(space={"x": optuna.distributions.FloatDistribution(0.5, 2.0)},
                         metric=["score", "it"], mode=["max", "min"])
    grid = tune.Tuner(tune_loop, param_space={"iterations": 2}, tune_config=tune.TuneConfig(
        num_samples=3, seed=3, search_alg=multi),
        run_config=RunConfig(name="multi", storage_path=storage, verbose=0)).fit()
    assert grid.num_terminated == 3
    study = optuna.load_study(study_name="multi",
                              storage=study_storage(Storage.from_url(os.path.join(storage, "multi")), optuna))
    assert len(study.directions) == 2
    assert sorted(t.values[0] for t in study.trials) == sorted(r.metrics["score"] for r in grid)
    with pytest.raises(ValueError, match="same length"):
        OptunaSearch(metric=["a", "b"], mode="min")
    with pytest.raises(ValueError, match="evaluated_rewards.*Hint"):
        OptunaSearch(points_to_evaluate=[{"x": 1.0}], evaluated_rewards=[0.5])


# -- asynchronous PBT: an exploit of a donor that is further on -------------------------------------

LATER_DONOR = """
import sys
from tune_loops import tune_loop
from unbroken import tune
from unbroken.train import RunConfig
from unbroken.tune.schedulers import PopulationBasedTraining

pbt = PopulationBasedTraining(perturbation_interval=2, quantile_fraction=0.5, resample_probability=0.0,
                              hyperparam_mutations={"x": [1, 2, 3, 4]})
grid = tune.Tuner(tune_loop, param_space={"x": tune.grid_search([1, 3]), "iterations": 6, "block_it": 1,
                                          "echo": True},
                  tune_config=tune.TuneConfig(metric="score", mode="max", scheduler=pbt, seed=1),
                  run_config=RunConfig(name="later", storage_path=sys.argv[1], verbose=0)).fit()
print("DONE", [r.trial_status for r in grid], flush=True)
"""


def test_an_asynchronous_exploit_of_a_donor_further_on_is_in_the_lineage_and_the_history(storage, tmp_path):
    """Trial 0 blocks after its first report until trial 1 has paused at 4; then it pauses at 2
    and takes trial 1's checkpoint of a later iteration. Its history keeps its own rows 1-2 and
    goes on after the donor's iteration, each iteration once; `unbroken show` says where the
    rows after 2 came from."""
    block = str(tmp_path / "block")
    fifo(block, "trial_00000")
    driver = start_script(LATER_DONOR, storage, **{BLOCK_ENV: block})
    read_until(driver, "trial_00001 REPORTED 5")  # it paused at 4 (a pause prints nothing)
    with open(os.path.join(block, "trial_00000"), "w"):
        pass  # trial 0 reads the end of the FIFO and goes on
    lines = read_until(driver, "DONE")
    driver.wait()
    assert "DONE ['TERMINATED', 'TERMINATED']" in lines[-1], "".join(lines)
    path = os.path.join(storage, "later")
    [exploit] = [e for e in json.load(open(os.path.join(path, "trial_00000", ".unbroken", "pbt.json")))
                 if e["t"] == 2]
    donor_at = int(exploit["checkpoint"].rsplit("_", 1)[1])
    assert exploit["donor"] == "trial_00001" and donor_at >= 4, exploit
    rows = tune.Tuner.restore(path, tune_loop).get_results()[0].rows
    its = [r["training_iteration"] for r in rows]
    assert its[:2] == [1, 2] and (its[2:] == list(range(donor_at + 1, 7))), its
    assert len(its) == len(set(its)), "each iteration once"
    shown = subprocess.run([sys.executable, "-m", "unbroken", "show", os.path.join(path, "trial_00000")],
                           capture_output=True, text=True, check=True).stdout
    assert f"round 1 at 2: took trial_00001/{exploit['checkpoint']}" in shown, shown


# -- synchronous HyperBand --------------------------------------------------------------------------

HYPERBAND = """
import sys
from tune_loops import tune_loop
from unbroken import tune
from unbroken.train import RunConfig
from unbroken.tune.schedulers import HyperBandScheduler

hb = HyperBandScheduler(max_t=9, reduction_factor=3)
space = {"x": tune.grid_search([5, 1, 4, 2, 9, 3, 7, 6, 8]), "iterations": 20, "block_it": 2}
grid = tune.Tuner(tune_loop, param_space=space,
                  tune_config=tune.TuneConfig(metric="score", mode="max", scheduler=hb,
                                              max_concurrent_trials=2),
                  run_config=RunConfig(name=sys.argv[2], storage_path=sys.argv[1], verbose=0)).fit()
print("DONE", [(r.trial_name, r.trial_status, r.metrics["it"]) for r in grid], flush=True)
"""


def test_synchronous_hyperband_halves_each_bracket_at_its_rungs_and_its_decisions_survive_a_killed_driver(
        storage, tmp_path):
    """max_t=9, eta=3: the first bracket holds 9 trials and judges them at 1, 3 and 9. All 9
    run to 1 and pause; the best 3 (x = 9, 8, 7) go on to 3; the best of those (x = 9) runs
    to 9. The others stop where they were judged. Killed once while trial 4 (x = 9) blocks
    after its report 2, between rungs, the sweep ends as the uninterrupted one does."""
    reference = run_script(HYPERBAND, storage, "reference").stdout
    expected = {0: 1, 1: 1, 2: 1, 3: 1, 4: 9, 5: 1, 6: 3, 7: 1, 8: 3}
    done = next(line for line in reference.splitlines() if line.startswith("DONE"))
    got = eval(done[5:])
    assert {int(name[-1]): it for name, _, it in got} == expected, done
    assert {status for _, status, _ in got} == {"TERMINATED"}
    path = os.path.join(storage, "reference")
    records = sweep_json(path)["trials"]
    assert all(("HyperBand" in (t["stopped_early"] or "")) == (t["name"] != "trial_00004") for t in records)
    for name, _, it in got:
        rows = [json.loads(line) for line in open(os.path.join(path, name, "result.json"))]
        kept = [r["training_iteration"] for r in rows]
        assert kept == list(range(1, it + 1)), (name, kept)

    block = str(tmp_path / "block")
    fifo(block, "trial_00004")
    driver = start_script(HYPERBAND, storage, "killed", **{BLOCK_ENV: block})
    read_until(driver, "trial_00004 BLOCKING")
    kill_and_reap(driver)
    os.remove(os.path.join(block, "trial_00004"))
    again = run_script(HYPERBAND, storage, "killed").stdout
    assert next(line for line in again.splitlines() if line.startswith("DONE")) == done


# -- a Ray Tune example, ported by its imports, killed mid-sweep and restored ------------------------

EXAMPLE = """
import sys
from tune_loops import Recorder, tune_loop
from unbroken import tune
from unbroken.tune.schedulers import HyperBandScheduler
from unbroken.tune.search import BasicVariantGenerator, ConcurrencyLimiter
from unbroken.tune.stopper import CombinedStopper, MaximumIterationStopper, TrialPlateauStopper

param_space = {"base": tune.randint(1, 10), "x": tune.sample_from(lambda spec: spec.config.base * 2),
               "y": tune.qrandn(0, 1, 0.25), "cap": 5, "iterations": 20, "echo": True}
stopper = CombinedStopper(MaximumIterationStopper(max_iter=20),
                          TrialPlateauStopper(metric="score", std=0.01, num_results=3, grace_period=3))
tuner = tune.Tuner(
    tune_loop, param_space=param_space,
    tune_config=tune.TuneConfig(num_samples=9, metric="score", mode="max", seed=5,
                                scheduler=HyperBandScheduler(max_t=9, reduction_factor=3),
                                search_alg=ConcurrencyLimiter(BasicVariantGenerator(), max_concurrent=2)),
    run_config=tune.RunConfig(name=sys.argv[2], storage_path=sys.argv[1], stop=stopper, verbose=0,
                              callbacks=[Recorder(sys.argv[3])]))
results = tuner.fit() if not tune.Tuner.can_restore(sys.argv[1] + "/" + sys.argv[2]) else \\
    tune.Tuner.restore(sys.argv[1] + "/" + sys.argv[2], tune_loop).fit()
best = results.get_best_result()
print("DONE", sorted((r.trial_name, r.metrics["it"], r.metrics["score"]) for r in results), best.config["x"],
      flush=True)
"""


def test_a_ray_tune_example_ported_by_its_imports_is_killed_mid_sweep_and_restored(storage, tmp_path):
    """HyperBand, a combined stopper, sample_from and qrandn, a ConcurrencyLimiter and a sweep
    callback, as a Ray Tune example writes them: killed after its fifth reported row (inside
    the bracket's best trial), then restored with Tuner.restore; it ends as the uninterrupted
    sweep does, and the callback saw each result once."""
    def done(out):
        return next(line for line in out.splitlines() if line.startswith("DONE"))

    reference = done(run_script(EXAMPLE, storage, "reference", str(tmp_path / "reference.jsonl")).stdout)
    log = str(tmp_path / "killed.jsonl")
    driver = start_script(EXAMPLE, storage, "killed", log)
    seen = 0
    for line in driver.stdout:
        seen += "REPORTED" in line
        if seen == 5:
            break
    kill_and_reap(driver)
    assert seen == 5 and sweep_json(os.path.join(storage, "killed"))["status"] == "RUNNING"
    assert done(run_script(EXAMPLE, storage, "killed", log).stdout) == reference
    results = [tuple(e[1:3]) for e in events(log) if e[0] == "result"]
    assert len(results) == len(set(results)), "each result once across the kill"
    assert sorted(results) == sorted(tuple(e[1:3]) for e in events(str(tmp_path / "reference.jsonl"))
                                     if e[0] == "result")


def test_optuna_search_seed_seeds_its_proposals_whatever_the_sweep_s_seed(storage):
    from unbroken.tune.search import OptunaSearch

    def first_config(name, sweep_seed):
        grid = tune.Tuner(tune_loop, param_space={"x": tune.uniform(0, 1), "iterations": 1},
                          tune_config=tune.TuneConfig(num_samples=1, metric="score", mode="max",
                                                      seed=sweep_seed, search_alg=OptunaSearch(seed=7)),
                          run_config=RunConfig(name=name, storage_path=storage, verbose=0)).fit()
        return grid[0].config["x"]

    assert first_config("a", 1) == first_config("b", 2)
