"""Sweeps (SPEC section 5): Tuner, Tuner.restore, search, ASHA, and sweep drivers that are
killed and restored. Every trial is a real run driven by real processes."""

import json
import logging
import os
import select
import signal
import subprocess
import sys

import pytest

from conftest import (
    attempts,
    fifo,
    kill_and_reap,
    read_until_all,
    run_json,
    run_script,
    start_script,
    statuses,
    sweep_json,
)
from tune_loops import ACTIVE_ENV, BLOCK_ENV, asha_loop, max_running, must_not_run, tune_loop, write_config
from unbroken import cli, tune
from unbroken.cli import inspection
from unbroken.errors import (
    LeaseHeldError,
    NotASweepError,
    RunExistsError,
    RunNotFoundError,
    SearchSpaceError,
    SweepMismatchError,
    TrainingFailedError,
    UnknownMetricError,
    UnsavableArgumentError,
)
from unbroken.train import DataParallelTrainer, Result, RunConfig, ScalingConfig
from unbroken.tune import TuneConfig, Tuner
from unbroken.tune import search_space as ss

# -- helpers ----------------------------------------------------------------------------------


def timeline(result, *columns):
    df = result.metrics_dataframe
    return [tuple(row) for row in df[list(columns)].itertuples(index=False)]


VOLATILE = ("time_total_s", "time_this_iter_s", "time_checkpoint_s", "timestamp", "attempt",
            "iterations_since_restore", "time_since_restore")


def summary(grid):
    """What must match between an interrupted and an uninterrupted sweep: each trial's name,
    status, config, early stop and metric rows (each iteration once), less times and attempts."""
    return [(r.trial_name, r.trial_status, r.config, r.stopped_early,
             [{k: v for k, v in row.items() if k not in VOLATILE} for row in r.rows])
            for r in grid]


def clear_dir(d):
    for name in os.listdir(d) if os.path.isdir(d) else []:
        if name != "max":
            os.remove(os.path.join(d, name))


SPACE8 = {"x": tune.grid_search([1, 2, 3, 4]), "y": tune.uniform(0, 1), "iterations": 4, "fail_x": 2,
          "echo": True}

DRIVER8 = """
import logging, sys
from tune_loops import tune_loop
from unbroken import tune
from unbroken.cli import inspection
from unbroken.train import RunConfig
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
space = {"x": tune.grid_search([1, 2, 3, 4]), "y": tune.uniform(0, 1), "iterations": 4, "fail_x": 2,
         "echo": True}
grid = tune.Tuner(tune_loop, param_space=space,
                  tune_config=tune.TuneConfig(num_samples=2, metric="score", mode="max", seed=11,
                                              max_concurrent_trials=2),
                  run_config=RunConfig(name="sweep8", storage_path=sys.argv[1])).fit()
print("DONE", len(grid), grid.num_terminated, grid.num_errors)
"""

RESTORE = """
import logging, sys
from tune_loops import tune_loop
from unbroken import tune
from unbroken.cli import inspection
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
assert tune.Tuner.can_restore(sys.argv[1])
grid = tune.Tuner.restore(sys.argv[1], tune_loop).fit()
print("DONE", len(grid), grid.num_terminated, grid.num_errors)
"""


# -- search space -----------------------------------------------------------------------------

def test_search_space_is_reproducible_and_repeats_grids():
    space = {"a": tune.grid_search([1, 2, 3]), "nested": {"lr": tune.loguniform(1e-4, 1e-1),
                                                          "n": tune.randint(1, 5)},
             "opt": tune.choice(["sgd", "adam"]), "b": tune.grid_search(["u", "v"]), "const": [1, 2]}
    assert ss.grid_size(space) == 6
    configs = [ss.resolve(space, ss.sample(space, 3, i)) for i in range(12)]
    # num_samples repeats the grid: every grid point twice, the first sorted grid key fastest.
    grid = [(1, "u"), (2, "u"), (3, "u"), (1, "v"), (2, "v"), (3, "v")]
    assert [(c["a"], c["b"]) for c in configs[:6]] == grid
    assert [(c["a"], c["b"]) for c in configs[6:]] == [(c["a"], c["b"]) for c in configs[:6]]
    for c in configs:
        assert 1e-4 <= c["nested"]["lr"] <= 1e-1 and 1 <= c["nested"]["n"] < 5 and c["opt"] in ("sgd", "adam")
        assert c["const"] == [1, 2]
    # The same (seed, index) always gives the same config, whatever the dict order.
    reordered = {"const": [1, 2], "b": space["b"], "opt": space["opt"],
                 "nested": {"n": tune.randint(1, 5), "lr": tune.loguniform(1e-4, 1e-1)}, "a": space["a"]}
    assert [ss.resolve(reordered, ss.sample(reordered, 3, i)) for i in range(12)] == configs
    assert ss.sample(space, 4, 0) != ss.sample(space, 3, 0)


def test_bad_search_space_values_are_refused_with_a_hint():
    import optuna

    cases = [
        (lambda: tune.uniform(1.0, 0.5), "lower must be below upper"),
        (lambda: tune.loguniform(0, 1), "lower > 0"),
        (lambda: tune.randint(3, 3), "lower must be below upper"),
        (lambda: tune.choice([]), "at least one value"),
        (lambda: tune.grid_search("abc"), "list of values"),
        (lambda: Tuner(tune_loop, param_space={"lr": {1: [tune.uniform(0, 1)]}}), "non-string key"),
        (lambda: Tuner(tune_loop, param_space={"lr": optuna.distributions.FloatDistribution(0, 1)}),
         "cannot sample"),
    ]
    for make, words in cases:
        with pytest.raises(SearchSpaceError) as info:
            make()
        assert words in str(info.value)
    trainer = DataParallelTrainer(write_config, train_loop_config={"a": 1})
    with pytest.raises(ValueError) as info:
        Tuner(trainer, param_space={"lr": tune.uniform(0, 1)})
    assert "train_loop_config" in str(info.value)
    with pytest.raises(TypeError):
        Tuner(DataParallelTrainer)


# -- fit ----------------------------------------------------------------------------------------

def test_function_sweep_runs_each_trial_as_a_run(storage, tmp_path, monkeypatch):
    active = str(tmp_path / "active")
    monkeypatch.setenv(ACTIVE_ENV, active)
    tuner = Tuner(tune_loop, param_space={"x": tune.grid_search([1, 2]), "y": tune.uniform(0, 1),
                                          "iterations": 3},
                  tune_config=TuneConfig(num_samples=2, metric="score", mode="max", seed=1,
                                         max_concurrent_trials=2),
                  run_config=RunConfig(name="fn", storage_path=storage))
    grid = tuner.fit()
    path = os.path.join(storage, "fn")
    assert len(grid) == 4 and grid.num_terminated == 4 and grid.num_errors == 0 and grid.errors == []
    assert [r.trial_name for r in grid] == [f"trial_0000{i}" for i in range(4)]
    for i, result in enumerate(grid):
        assert isinstance(result, Result) and result.config["x"] == [1, 2][i % 2]
        assert result.metrics["score"] == pytest.approx(result.config["x"] * 3 + result.config["y"])
        trial = os.path.join(path, result.trial_name)
        assert result.path == trial and result.checkpoint.path.endswith("checkpoint_000003")
        for name in ("result.json", "progress.csv", "params.json", ".unbroken/run.json"):
            assert os.path.exists(os.path.join(trial, name)), name
        assert run_json(trial)["status"] == "FINISHED"
        assert DataParallelTrainer.can_restore(trial), "a trial is an ordinary run"
    assert max_running(active) <= 2
    best = grid.get_best_result()
    assert best.config["x"] == 2 and best is grid[max((1, 3), key=lambda i: grid[i].metrics["score"])]
    assert grid.get_best_result("score", "min").config["x"] == 1
    with pytest.raises(UnknownMetricError):
        grid.get_best_result("nope", "max")
    df = grid.get_dataframe()
    assert list(df["config/x"]) == [1, 2, 1, 2] and list(df["trial_status"]) == ["TERMINATED"] * 4
    listed = subprocess.run([sys.executable, "-m", "unbroken", "ls", storage, "--json"],
                            capture_output=True, text=True, check=True)
    [row] = [r for r in json.loads(listed.stdout) if r["name"] == "fn"]
    assert row["kind"] == "sweep" and row["trials"] == {"TERMINATED": 4}
    assert list(grid.get_dataframe(filter_metric="score", filter_mode="min")["it"]) == [1] * 4
    manifest = sweep_json(path)
    assert manifest["status"] == "FINISHED" and manifest["seed"] == 1
    assert [t["values"]["x"] for t in manifest["trials"]] == [0, 1, 0, 1]
    # fit() again: the finished sweep returns its stored results without running anything.
    again = Tuner(must_not_run, param_space=tuner.param_space, tune_config=tuner.tune_config,
                  run_config=RunConfig(name="fn", storage_path=storage)).fit()
    assert summary(again) == summary(grid)


def test_trainer_trainable_merges_its_train_loop_config(storage):
    trainer = DataParallelTrainer(write_config, train_loop_config={"base": 1, "nested": {"a": 1, "b": 2}},
                                  scaling_config=ScalingConfig(num_workers=2))
    grid = Tuner(trainer, param_space={"train_loop_config": {"x": tune.grid_search([1, 2]),
                                                             "nested": {"b": tune.choice([5])}}},
                 run_config=RunConfig(name="tr", storage_path=storage)).fit()
    assert grid.num_terminated == 2
    for i, result in enumerate(grid):
        got = json.loads(result.metrics["config"])
        assert got == {"base": 1, "nested": {"a": 1, "b": 5}, "x": i + 1}
        assert result.metrics["trial_name"] == f"trial_0000{i}"
        assert result.metrics["trial_id"].endswith(f"_0000{i}")
        manifest = run_json(result.path)
        assert manifest["trainer_class"] == "unbroken.trainer:DataParallelTrainer"
        assert manifest["attempts"][0]["num_workers"] == 2
    # Restored without passing the trainable: the saved Trainer is rebuilt.
    restored = Tuner.restore(os.path.join(storage, "tr"))
    assert isinstance(restored.trainable, DataParallelTrainer)
    assert summary(restored.fit()) == summary(grid)


# -- errored trials -------------------------------------------------------------------------------

def test_errored_trials_are_skipped_resumed_or_restarted_on_restore(storage, tmp_path):
    def errored_sweep(name):
        space = {"x": tune.grid_search([1, 2]), "fail_once": str(tmp_path / f"{name}.failed"),
                 "iterations": 4}
        grid = Tuner(tune_loop, param_space=space,
                     tune_config=TuneConfig(metric="score", mode="max", max_concurrent_trials=1),
                     run_config=RunConfig(name=name, storage_path=storage)).fit()
        return grid, os.path.join(storage, name)

    grid, path = errored_sweep("resume")
    assert grid.num_errors == 1 and grid.num_terminated == 1
    assert isinstance(grid.errors[0], TrainingFailedError) and "one-time failure" in str(grid.errors[0])
    assert grid[0].trial_status == "ERROR" and grid[1].trial_status == "TERMINATED"
    # Default restore: errored trials are skipped.
    skipped = Tuner.restore(path, tune_loop).fit()
    assert skipped.num_errors == 1 and attempts(os.path.join(path, "trial_00000")) == ["ERRORED"]
    # resume_errored: the trial continues from its checkpoints.
    resumed = Tuner.restore(path, tune_loop, resume_errored=True).fit()
    assert resumed.num_errors == 0 and resumed.num_terminated == 2
    trial = os.path.join(path, "trial_00000")
    assert attempts(trial) == ["ERRORED", "FINISHED"]
    assert run_json(trial)["attempts"][1]["resumed_from"] == "checkpoint_000001"
    assert timeline(resumed[0], "training_iteration", "attempt") == [(1, 1), (2, 2), (3, 2), (4, 2)]
    assert attempts(os.path.join(path, "trial_00001")) == ["FINISHED"], "finished trials are kept"

    grid, path = errored_sweep("restart")
    restarted = Tuner.restore(path, tune_loop, restart_errored=True).fit()
    assert restarted.num_errors == 0
    trial = os.path.join(path, "trial_00000")
    assert attempts(trial) == ["FINISHED"] and run_json(trial)["attempts"][0]["resumed_from"] is None
    kept = os.path.join(path, ".unbroken", "restarted", "trial_00000.1")
    assert attempts(kept) == ["ERRORED"], "the errored run is kept aside, not overwritten"
    assert sweep_json(path)["trials"][0]["restarts"] == 1


# -- the sweep driver killed with SIGKILL, restored twice ----------------------------------------------

def test_sweep_driver_sigkill_twice_ends_like_an_uninterrupted_sweep(storage, tmp_path, capsys):
    block, active = str(tmp_path / "block"), str(tmp_path / "active")
    env = {BLOCK_ENV: block, ACTIVE_ENV: active}
    path = os.path.join(storage, "sweep8")

    # Driver 1: trial 0 finishes, trial 1 errors, trials 2 and 3 block while running; 4-7 pending.
    fifo(block, "trial_00002")
    fifo(block, "trial_00003")
    driver = start_script(DRIVER8, storage, **env)
    read_until_all(driver, ["trial_00002 BLOCKING", "trial_00003 BLOCKING"])
    at_kill = statuses(path)
    kill_and_reap(driver)
    assert at_kill["trial_00000"] == "TERMINATED" and at_kill["trial_00001"] == "ERROR"
    assert at_kill["trial_00002"] == at_kill["trial_00003"] == "RUNNING"
    assert {at_kill[f"trial_0000{i}"] for i in range(4, 8)} == {"PENDING"}
    assert Tuner.can_restore(path)
    # `unbroken ls` tells it as it is: the driver is gone, so the sweep and its running trials
    # were aborted (sweep.json still says RUNNING).
    [listed] = [r for r in inspection.list_runs(storage) if r.kind == "sweep"]
    assert listed.status == "ABORTED" and listed.recorded_status == "RUNNING"
    assert "RUNNING" not in listed.trials and listed.trials["ABORTED"] == 2 and listed.trials["PENDING"] == 4
    # `unbroken show <sweep>` shows the sweep (it said "no run here" before).
    assert cli.main(["show", path]) == 0
    shown = capsys.readouterr().out
    assert "ABORTED (sweep.json says RUNNING" in shown and "\nbest trial  trial_0000" in shown
    assert [line.split()[:2] for line in shown.splitlines() if line.startswith("  trial_0000")] == [
        ["trial_00000", "TERMINATED"], ["trial_00001", "ERROR"], ["trial_00002", "ABORTED"],
        ["trial_00003", "ABORTED"]] + [[f"trial_0000{i}", "PENDING"] for i in range(4, 8)]

    # Driver 2 (Tuner.restore): trials 2 and 3 resume, 4 and 5 run, 6 and 7 block; killed again.
    for name in ("trial_00002", "trial_00003"):
        os.remove(os.path.join(block, name))
    fifo(block, "trial_00006")
    fifo(block, "trial_00007")
    clear_dir(active)
    driver = start_script(RESTORE, path, **env)
    read_until_all(driver, ["trial_00006 BLOCKING", "trial_00007 BLOCKING", "trial_00005 ERROR"])
    kill_and_reap(driver)

    # Driver 3: the same script as driver 1, run again, auto-resumes the sweep and finishes it.
    for name in ("trial_00006", "trial_00007"):
        os.remove(os.path.join(block, name))
    clear_dir(active)
    out = run_script(DRIVER8, storage, **env).stdout
    assert "DONE 8 6 2" in out, out
    assert max_running(active) <= 2, "max_concurrent_trials holds after each restore"

    grid = Tuner.restore(path, tune_loop).get_results()
    reference = Tuner(tune_loop, param_space=SPACE8,
                      tune_config=TuneConfig(num_samples=2, metric="score", mode="max", seed=11,
                                             max_concurrent_trials=2),
                      run_config=RunConfig(name="reference", storage_path=storage)).fit()
    assert summary(grid) == summary(reference)
    assert [r.trial_status for r in grid] == ["TERMINATED", "ERROR", "TERMINATED", "TERMINATED"] * 2
    resumed, once = ["ABORTED", "FINISHED"], ["FINISHED"]
    expected = [once, ["ERRORED"], resumed, resumed, once, ["ERRORED"], resumed, resumed]
    for result, want in zip(grid, expected, strict=True):
        assert attempts(result.path) == want, f"{result.trial_name} ran exactly once, resumed when killed"
        if result.trial_status == "TERMINATED":
            assert [row["training_iteration"] for row in result.rows] == [1, 2, 3, 4], "each iteration once"
    manifest = sweep_json(path)
    assert manifest["status"] == "FINISHED" and [t["index"] for t in manifest["trials"]] == list(range(8))
    assert not os.path.exists(os.path.join(path, ".unbroken", "lease.json"))


QUIET_SWEEP = """
import sys
from tune_loops import tune_loop
from unbroken import tune
from unbroken.train import RunConfig
tune.Tuner(tune_loop, param_space={"x": tune.grid_search([1, 2, 3]), "iterations": 2},
           tune_config=tune.TuneConfig(max_concurrent_trials=1, metric="score", mode="max"),
           run_config=RunConfig(name="progress", storage_path=sys.argv[1])).fit()
"""


def test_a_sweep_shows_its_progress_where_nobody_configured_logging(storage):
    lines = [line for line in run_script(QUIET_SWEEP, storage).stderr.splitlines()
             if line.startswith("unbroken: sweep progress: ")]
    ended = [line.removeprefix("unbroken: sweep progress: ") for line in lines if " TERMINATED " in line]
    assert len(ended) == 3, lines
    assert ended[0].startswith("trial_00000 TERMINATED (score=2.0); 1/3 done, 0 running, 2 pending, ETA ")
    assert ended[1].startswith("trial_00001 TERMINATED (score=4.0); 2/3 done, 0 running, 1 pending, ETA ")
    assert ended[2] == "trial_00002 TERMINATED (score=6.0); 3/3 done, 0 running, 0 pending"
    started = [line for line in lines if " started with " in line]
    assert "; 1/3 done, 1 running, 1 pending, ETA " in started[1], started
    assert lines[-1] == "unbroken: sweep progress: FINISHED: 3 TERMINATED"


# -- signals ------------------------------------------------------------------------------------------

SIGNALLED = """
import logging, sys
from tune_loops import tune_loop
from unbroken import tune
from unbroken.cli import inspection
from unbroken.errors import TrainingInterruptedError
from unbroken.train import RunConfig
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
try:
    tune.Tuner(tune_loop, param_space={"x": tune.grid_search([1, 2]), "iterations": 6, "ckpt_every": 5},
               tune_config=tune.TuneConfig(max_concurrent_trials=2),
               run_config=RunConfig(name="signalled", storage_path=sys.argv[1])).fit()
    print("FINISHED")
except TrainingInterruptedError as e:
    print("INTERRUPTED", str(e).replace(chr(10), " "))
"""


def test_sigterm_to_the_sweep_driver_checkpoints_and_stops_every_trial(storage, tmp_path):
    block = str(tmp_path / "block")
    fifo(block, "trial_00000")
    fifo(block, "trial_00001")
    path = os.path.join(storage, "signalled")
    driver = start_script(SIGNALLED, storage, **{BLOCK_ENV: block})
    try:
        read_until_all(driver, ["trial_00000 BLOCKING", "trial_00001 BLOCKING"])
        # A second driver of the same sweep is refused while the first one lives.
        with pytest.raises(LeaseHeldError) as info:
            Tuner(tune_loop, param_space={"x": tune.grid_search([1, 2]), "iterations": 6, "ckpt_every": 5},
                  tune_config=TuneConfig(max_concurrent_trials=2),
                  run_config=RunConfig(name="signalled", storage_path=storage)).fit()
        assert f"pid {driver.pid}" in str(info.value)
        driver.send_signal(signal.SIGTERM)
        read_until_all(driver, ["SIGTERM received: forwarded to 2 running trial(s)"])
    finally:
        for name in ("trial_00000", "trial_00001"):
            with open(os.path.join(block, name), "w") as f:
                f.write("go")
    out, err = driver.communicate(timeout=120)
    assert "INTERRUPTED" in out and f"Tuner.restore({path!r}, trainable)" in out, out + err
    assert sweep_json(path)["status"] == "INTERRUPTED"
    assert set(statuses(path).values()) == {"INTERRUPTED"}
    for name in ("trial_00000", "trial_00001"):
        manifest = run_json(os.path.join(path, name))
        assert manifest["status"] == "INTERRUPTED" and manifest["latest_checkpoint"] is not None

    # resume_unfinished=False leaves the interrupted trials as they are.
    left = Tuner.restore(path, tune_loop, resume_unfinished=False).fit()
    assert [r.trial_status for r in left] == ["INTERRUPTED"] * 2
    assert attempts(os.path.join(path, "trial_00000")) == ["PREEMPTED"]
    grid = Tuner.restore(path, tune_loop).fit()
    assert grid.num_terminated == 2 and grid.status == "FINISHED"
    for result in grid:
        assert [row["training_iteration"] for row in result.rows] == list(range(1, 7))
        assert attempts(result.path) == ["PREEMPTED", "FINISHED"]


# -- auto-resume, extension, bad input --------------------------------------------------------------

def small_tuner(storage, name="small", **tune_kwargs):
    space = tune_kwargs.pop("param_space", {"x": tune.grid_search([1, 2]), "y": tune.uniform(0, 1),
                                            "iterations": 2})
    config = TuneConfig(**{"metric": "score", "mode": "max", "seed": 5, **tune_kwargs})
    return Tuner(tune_loop, param_space=space, tune_config=config,
                 run_config=RunConfig(name=name, storage_path=storage))


def test_rerun_with_another_search_space_is_refused_with_the_ways_out(storage):
    small_tuner(storage).fit()
    path = os.path.join(storage, "small")
    before = open(os.path.join(path, ".unbroken", "sweep.json")).read()
    changed = {"x": tune.grid_search([1, 2]), "y": tune.uniform(0, 1), "iterations": 2, "extra": 1}
    with pytest.raises(SweepMismatchError) as info:
        small_tuner(storage, param_space=changed).fit()
    message = str(info.value)
    assert "param_space.extra: saved (absent) -> now 1" in message
    assert "Tuner.restore(" in message and "new name" in message
    with pytest.raises(SweepMismatchError) as info:
        small_tuner(storage, num_samples=2).fit()
    assert "num_samples: saved 1 -> now 2" in str(info.value)
    assert "tune_config=TuneConfig(num_samples=...)" in str(info.value)
    with pytest.raises(RunExistsError):
        Tuner(tune_loop, param_space={}, run_config=RunConfig(name="small", storage_path=storage,
                                                              resume="never")).fit()
    with pytest.raises(RunNotFoundError):
        Tuner(tune_loop, run_config=RunConfig(name="absent", storage_path=storage, resume="must")).fit()
    assert open(os.path.join(path, ".unbroken", "sweep.json")).read() == before, "nothing was written"
    # max_concurrent_trials may change freely.
    assert small_tuner(storage, max_concurrent_trials=1).fit().num_terminated == 2


def test_extending_a_finished_sweep_proposes_what_a_larger_sweep_would(storage):
    first = small_tuner(storage, name="grow").fit()
    path = os.path.join(storage, "grow")
    with pytest.raises(SweepMismatchError) as info:
        Tuner.restore(path, tune_loop, tune_config=TuneConfig(num_samples=3, metric="loss"))
    assert "only num_samples and max_concurrent_trials may change" in str(info.value)
    grown = Tuner.restore(path, tune_loop, tune_config=TuneConfig(num_samples=3)).fit()
    assert len(grown) == 6 and grown.num_terminated == 6
    assert summary(grown)[:2] == summary(first)
    for name in ("trial_00000", "trial_00001"):
        assert attempts(os.path.join(path, name)) == ["FINISHED"], "finished trials did not run again"
    larger = small_tuner(storage, name="larger", num_samples=3).fit()
    assert [r.config for r in grown] == [r.config for r in larger]
    # The extended sweep is now what a script with num_samples=3 describes: it auto-resumes.
    assert summary(small_tuner(storage, name="grow", num_samples=3).fit()) == summary(grown)


def test_restore_needs_a_sweep_root_and_keeps_the_param_space_keys(storage):
    small_tuner(storage, name="root").fit()
    path = os.path.join(storage, "root")
    trial = os.path.join(path, "trial_00000")
    DataParallelTrainer(write_config, run_config=RunConfig(name="single", storage_path=storage)).fit()
    single = os.path.join(storage, "single")

    assert Tuner.can_restore(path)
    for other in (trial, single, os.path.join(storage, "missing"), storage):
        assert not Tuner.can_restore(other)
    with pytest.raises(NotASweepError) as info:
        Tuner.restore(single, tune_loop)
    assert "single run" in str(info.value) and "restore(" in str(info.value)
    with pytest.raises(NotASweepError) as info:
        Tuner.restore(trial, tune_loop)
    assert f"Tuner.restore({path!r}" in str(info.value)
    with pytest.raises(RunNotFoundError):
        Tuner.restore(os.path.join(storage, "missing"), tune_loop)
    with pytest.raises(SweepMismatchError) as info:
        Tuner.restore(path, tune_loop, param_space={"x": tune.grid_search([1, 2]), "iterations": 2})
    assert "y" in str(info.value)
    with pytest.raises(SweepMismatchError):
        Tuner.restore(path, tune_loop, param_space={"x": tune.grid_search([1, 2]), "y": tune.uniform(0, 2),
                                                   "iterations": 2})
    with pytest.raises(RunExistsError):
        Tuner(tune_loop, run_config=RunConfig(name="single", storage_path=storage)).fit()

    # Re-specifying values is allowed; get_results() works without fit().
    restored = Tuner.restore(path, tune_loop, param_space={"x": tune.grid_search([1, 2]),
                                                            "y": tune.uniform(0, 1), "iterations": 3})
    grid = restored.get_results()
    assert len(grid) == 2 and grid.num_terminated == 2 and grid[0].config["iterations"] == 3


def test_param_space_objects_are_pickled_and_may_be_respecified(storage):
    import threading

    from tune_loops import Payload

    space = {"x": tune.grid_search([1, 2]), "payload": Payload(3), "iterations": 2}
    Tuner(tune_loop, param_space=space, run_config=RunConfig(name="objects", storage_path=storage)).fit()
    path = os.path.join(storage, "objects")
    manifest = sweep_json(path)
    assert "payload" not in manifest["params"]["param_space"]
    assert manifest["pickled_params"] == ["param_space/payload"]
    restored = Tuner.restore(path)
    assert restored.trainable is tune_loop and restored.param_space["payload"].n == 3
    assert [r.config["payload"].n for r in restored.get_results()] == [3, 3]
    respecified = Tuner.restore(path, tune_loop, param_space={**space, "payload": Payload(4)})
    assert [r.config["payload"].n for r in respecified.get_results()] == [4, 4]
    with pytest.raises(UnsavableArgumentError) as info:
        Tuner(tune_loop, param_space={"lock": threading.Lock()},
              run_config=RunConfig(name="lock", storage_path=storage)).fit()
    assert "param_space['lock']" in str(info.value)
    assert not os.path.exists(os.path.join(storage, "lock")), "nothing was written"


# -- ASHA ---------------------------------------------------------------------------------------------

ASHA_DRIVER = """
import logging, sys
from tune_loops import asha_loop
from unbroken import tune
from unbroken.cli import inspection
from unbroken.train import RunConfig
from unbroken.tune.schedulers import ASHAScheduler
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
grid = tune.Tuner(asha_loop, param_space={"x": tune.grid_search([2, 1, 3, 0.5])},
                  tune_config=tune.TuneConfig(metric="score", mode="max", max_concurrent_trials=1,
                                              scheduler=ASHAScheduler(max_t=4, grace_period=1,
                                                                      reduction_factor=2)),
                  run_config=RunConfig(name=sys.argv[2], storage_path=sys.argv[1])).fit()
print("DONE", [r.trial_status for r in grid])
"""


def test_asha_stops_trials_and_its_decisions_survive_a_killed_driver(storage, tmp_path):
    block = str(tmp_path / "block")
    path = os.path.join(storage, "asha")
    fifo(block, "trial_00002")
    driver = start_script(ASHA_DRIVER, storage, "asha", **{BLOCK_ENV: block})
    read_until_all(driver, ["trial_00002 BLOCKING"])
    at_kill = statuses(path)
    kill_and_reap(driver)
    assert at_kill == {"trial_00000": "TERMINATED", "trial_00001": "TERMINATED", "trial_00002": "RUNNING",
                       "trial_00003": "PENDING"}
    os.remove(os.path.join(block, "trial_00002"))
    grid = Tuner.restore(path, asha_loop).fit()
    reference = run_script(ASHA_DRIVER, storage, "asha-reference")
    assert "DONE ['TERMINATED', 'TERMINATED', 'TERMINATED', 'TERMINATED']" in reference.stdout
    assert summary(grid) == summary(Tuner.restore(os.path.join(storage, "asha-reference")).get_results())
    iterations = [[row["training_iteration"] for row in r.rows] for r in grid]
    assert iterations == [[1, 2, 3, 4], [1], [1, 2, 3, 4], [1]], "max_t stops 0 and 2; ASHA stops 1 and 3"
    assert [bool(r.stopped_early) for r in grid] == [False, True, False, True]
    assert "below the cutoff" in grid[1].stopped_early and grid.num_errors == 0
    assert attempts(os.path.join(path, "trial_00001")) == ["FINISHED"], "the stopped trial did not run again"
    assert attempts(os.path.join(path, "trial_00002")) == ["ABORTED", "FINISHED"]
    rungs = sorted(os.listdir(os.path.join(path, ".unbroken", "asha")))
    assert rungs == ["lock", "rung_1", "rung_2", "stopped"]
    # Restoring again changes nothing: stopped trials stay stopped.
    assert summary(Tuner.restore(path, asha_loop).fit()) == summary(grid)


# -- Optuna -----------------------------------------------------------------------------------------

OPTUNA_DRIVER = """
import logging, sys
from tune_loops import tune_loop
from unbroken import tune
from unbroken.cli import inspection
from unbroken.train import RunConfig
from unbroken.tune.search import OptunaSearch
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
grid = tune.Tuner(tune_loop, param_space={"x": tune.uniform(0, 4), "y": tune.choice([0.0, 0.5]),
                                          "iterations": 3},
                  tune_config=tune.TuneConfig(metric="score", mode="max", num_samples=5, seed=5,
                                              max_concurrent_trials=1, search_alg=OptunaSearch()),
                  run_config=RunConfig(name=sys.argv[2], storage_path=sys.argv[1])).fit()
print("DONE", len(grid), grid.num_terminated)
"""


def load_study(path, name):
    import optuna

    from unbroken.store.storage import Storage
    from unbroken.tune.search.optuna_journal import study_storage

    return optuna.load_study(study_name=name, storage=study_storage(Storage.from_url(path), optuna))


def study_trials(path, name):
    return load_study(path, name).get_trials(deepcopy=False)


def test_optuna_sweep_killed_and_restored_reopens_the_same_study(storage, tmp_path):
    pytest.importorskip("optuna")
    block = str(tmp_path / "block")
    path = os.path.join(storage, "opt")
    fifo(block, "trial_00002")
    driver = start_script(OPTUNA_DRIVER, storage, "opt", **{BLOCK_ENV: block})
    read_until_all(driver, ["trial_00002 BLOCKING"])
    kill_and_reap(driver)
    assert [t.state.name for t in study_trials(path, "opt")] == ["COMPLETE", "COMPLETE", "RUNNING"]
    os.remove(os.path.join(block, "trial_00002"))
    grid = Tuner.restore(path, tune_loop).fit()
    assert grid.num_terminated == 5, [r.error for r in grid]
    reference = run_script(OPTUNA_DRIVER, storage, "opt-reference")
    assert "DONE 5 5" in reference.stdout
    expected = Tuner.restore(os.path.join(storage, "opt-reference"), tune_loop).get_results()
    assert summary(grid) == summary(expected), "the restored sweep proposed what the uninterrupted one did"
    trials = study_trials(path, "opt")
    assert [t.number for t in trials] == list(range(5)) and {t.state.name for t in trials} == {"COMPLETE"}
    assert [t.value for t in trials] == [r.metrics["score"] for r in grid]
    assert [t.params["x"] for t in trials] == [r.config["x"] for r in grid]
    assert [r.config["y"] for r in grid] == [[0.0, 0.5][t.params["y"]] for t in trials]


def test_optuna_trial_asked_but_not_recorded_is_adopted(storage, caplog):
    import optuna

    from unbroken.tune.search import OptunaSearch

    space = {"x": tune.uniform(0, 4), "y": tune.choice([0.0, 0.5]), "iterations": 2}
    config = TuneConfig(metric="score", mode="max", num_samples=2, seed=1, search_alg=OptunaSearch())
    Tuner(tune_loop, param_space=space, tune_config=config,
          run_config=RunConfig(name="orphan", storage_path=storage)).fit()
    path = os.path.join(storage, "orphan")
    # As if a driver died between asking the study and recording the trial in the manifest.
    study = load_study(path, "orphan")
    study.enqueue_trial({"x": 1.25, "y": 1})
    study.ask({"x": optuna.distributions.FloatDistribution(0, 4),
               "y": optuna.distributions.CategoricalDistribution([0, 1])})
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        grid = Tuner.restore(path, tune_loop, tune_config=TuneConfig(num_samples=3)).fit()
    assert any("adopted trial_00002" in r.message for r in caplog.records)
    assert len(grid) == 3 and grid[2].config["x"] == 1.25 and grid[2].config["y"] == 0.5
    trials = study_trials(path, "orphan")
    assert len(trials) == 3 and trials[2].state.name == "COMPLETE"
    assert trials[2].value == pytest.approx(1.25 * 2 + 0.5)


def test_optuna_errored_trial_rerun_is_told_as_a_new_study_trial(storage, tmp_path):
    from unbroken.tune.search import OptunaSearch

    space = {"x": tune.uniform(0, 4), "iterations": 3, "fail_once": str(tmp_path / "failed")}
    config = TuneConfig(metric="score", mode="max", num_samples=2, seed=2, max_concurrent_trials=1,
                        search_alg=OptunaSearch())
    grid = Tuner(tune_loop, param_space=space, tune_config=config,
                 run_config=RunConfig(name="rerun", storage_path=storage)).fit()
    path = os.path.join(storage, "rerun")
    assert [r.trial_status for r in grid] == ["ERROR", "TERMINATED"]
    assert [t.state.name for t in study_trials(path, "rerun")] == ["FAIL", "COMPLETE"]
    grid = Tuner.restore(path, tune_loop, resume_errored=True).fit()
    assert [r.trial_status for r in grid] == ["TERMINATED", "TERMINATED"]
    trials = study_trials(path, "rerun")
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE", "COMPLETE"]
    assert trials[2].params == trials[0].params and trials[2].value == grid[0].metrics["score"]
    # Telling is idempotent: restoring again adds nothing.
    Tuner.restore(path, tune_loop, resume_errored=True).fit()
    assert len(study_trials(path, "rerun")) == 3


UNCLEAN = """
import sys, torch
from unbroken import tune
from unbroken.cli import inspection
from unbroken.execution.engine.local import start_method
from unbroken.train import RunConfig
torch.manual_seed(0)
(torch.randn(256, 256) @ torch.randn(256, 256)).sum()  # starts torch's thread pool: no more forking
assert start_method() != "fork"

def trainable(config):  # defined in __main__: reaches the spawned trial by value
    for it in range(1, 3):
        tune.report({"score": config["x"] * it})

grid = tune.Tuner(trainable, param_space={"x": tune.grid_search([1, 2])},
                  run_config=RunConfig(name="unclean", storage_path=sys.argv[1])).fit()
print("SCORES", [r.metrics["score"] for r in grid], grid.num_errors)
"""


def test_trials_are_spawned_when_the_sweep_driver_cannot_fork(storage):
    out = run_script(UNCLEAN, storage).stdout
    assert "SCORES [2, 4] 0" in out


def test_trial_processes_die_with_a_killed_sweep_driver(storage, tmp_path):
    block = str(tmp_path / "block")
    fifo(block, "trial_00000")
    driver = start_script(DRIVER8.replace("sweep8", "orphans"), storage, **{BLOCK_ENV: block})
    read_until_all(driver, ["trial_00000 BLOCKING"])
    children = [int(p) for p in open(f"/proc/{driver.pid}/task/{driver.pid}/children").read().split()
                if "resource_tracker" not in open(f"/proc/{p}/cmdline").read()]  # spawn's helper
    assert children
    kill_and_reap(driver)
    for pid in children:  # woken by each process's exit (a pidfd), never by a timer
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            assert select.select([fd], [], [], 10)[0], "trial processes die with their sweep driver"
        finally:
            os.close(fd)


@pytest.mark.slow
def test_sweep_killed_at_many_moments_ends_like_an_uninterrupted_sweep(storage):
    """Soak: SIGKILL the sweep driver after a random number of reported rows, again and again,
    restoring each time by running the same script, until the sweep finishes."""
    import random

    rng = random.Random(2024)
    path = os.path.join(storage, "sweep8")
    kills = 0
    while True:
        driver = start_script(DRIVER8, storage)
        target, seen, finished = rng.randint(1, 10), 0, False
        for line in driver.stdout:
            seen += "REPORTED" in line
            finished = finished or line.startswith("DONE")
            if seen >= target and not finished:
                break
        if finished:
            driver.wait()
            break
        kill_and_reap(driver)
        kills += 1
        assert kills < 40, "the sweep makes progress across kills"
    grid = Tuner.restore(path, tune_loop).get_results()
    reference = Tuner(tune_loop, param_space=SPACE8,
                      tune_config=TuneConfig(num_samples=2, metric="score", mode="max", seed=11,
                                             max_concurrent_trials=2),
                      run_config=RunConfig(name="reference", storage_path=storage)).fit()
    assert kills >= 3 and summary(grid) == summary(reference)
