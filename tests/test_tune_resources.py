"""tune.with_parameters, tune.with_resources and class trainables (tune.Trainable): objects
handed to a trainable without being saved anywhere, the resources each trial takes (CPUs, GPUs
given out per trial), and Ray Tune's class API resumed from its checkpoints."""

import json
import os
import zlib

import pytest

from conftest import read_until, run_json, run_script, start_script, statuses
from tune_loops import ACTIVE_ENV, BLOCK_ENV, Counter, gpu_env_loop, max_running, param_loop, tune_loop
from unbroken import tune
from unbroken.errors import InsufficientResourcesError, RestoreArgumentError
from unbroken.train import CheckpointConfig, DataParallelTrainer, FailureConfig, RunConfig, ScalingConfig
from unbroken.tune import Tuner
from unbroken.tune.gpu_slots import GpuSlots, gpus_per_trial

DATA = bytes(range(256)) * (12 << 10)  # 3 MiB, recognisable
Y = zlib.crc32(DATA) % 1000

DRIVER = """
import sys
from tune_loops import param_loop
from test_tune_resources import DATA
from unbroken import tune
from unbroken.train import RunConfig
grid = tune.Tuner(tune.with_parameters(param_loop, data=DATA),
                  param_space={"x": tune.grid_search([1, 2, 3]), "iterations": 3, "echo": True},
                  tune_config=tune.TuneConfig(max_concurrent_trials=1),
                  run_config=RunConfig(name="params", storage_path=sys.argv[1])).fit()
"""


def stored_bytes(path: str) -> tuple[int, bool]:
    """All bytes under `path`, and whether any file holds a piece of DATA."""
    total, found = 0, False
    piece = DATA[1000:1256]
    for d, _, files in os.walk(path):
        for name in files:
            blob = open(os.path.join(d, name), "rb").read()
            total += len(blob)
            found = found or piece in blob
    return total, found


def test_with_parameters_hands_each_trial_the_objects_and_saves_them_nowhere(storage, tmp_path):
    block = str(tmp_path / "block")
    os.makedirs(block)
    os.mkfifo(os.path.join(block, "trial_00001"))
    path = os.path.join(storage, "params")
    driver = start_script(DRIVER, storage, **{BLOCK_ENV: block})
    read_until(driver, "trial_00001 BLOCKING")  # after its report 2
    driver.kill()
    driver.wait()
    driver.stdout.close()
    driver.stderr.close()
    assert statuses(path) == {"trial_00000": "TERMINATED", "trial_00001": "RUNNING", "trial_00002": "PENDING"}
    os.remove(os.path.join(block, "trial_00001"))

    with pytest.raises(RestoreArgumentError, match=r"with_parameters.*Hint: pass it again.*data=\.\.\."):
        Tuner.restore(path).fit()
    grid = Tuner.restore(path, trainable=tune.with_parameters(param_loop, data=DATA)).fit()
    assert [r.metrics["score"] for r in grid] == [x * 3 + Y for x in (1, 2, 3)]
    assert grid.num_errors == 0
    trial = run_json(os.path.join(path, "trial_00001"))
    assert trial["must_respecify"] == ["train_loop_per_worker"]
    assert [a["status"] for a in trial["attempts"]][-1] == "FINISHED" and len(trial["attempts"]) == 2
    total, found = stored_bytes(path)
    assert not found and total < len(DATA) // 4, (total, "the objects are in no file of the sweep")


def test_with_parameters_and_with_resources_refuse_what_they_cannot_take():
    with pytest.raises(ValueError, match="at least one keyword argument"):
        tune.with_parameters(tune_loop)
    with pytest.raises(ValueError, match="`config` is the trial's config"):
        tune.with_parameters(tune_loop, config={})
    with pytest.raises(TypeError, match="takes a function trainable, got a DataParallelTrainer"):
        tune.with_resources(DataParallelTrainer(tune_loop), {"cpu": 1})
    with pytest.raises(TypeError, match="takes a function"):
        tune.with_parameters(Tuner, data=1)
    with pytest.raises(TypeError, match="a function of the config"):
        tune.with_resources(tune_loop, lambda config: {"cpu": 1})
    with pytest.raises(ValueError, match="'cpu' must be a number >= 0"):
        tune.with_resources(tune_loop, {"cpu": -1})
    with pytest.raises(ValueError, match="runs on one worker"):
        tune.with_resources(tune_loop, ScalingConfig(num_workers=2))
    both = tune.with_resources(tune.with_parameters(param_loop, data=b"x"), {"cpu": 2, "gpu": 1, "custom": 3})
    assert both.parameters == {"data": b"x"} and both.__name__ == "param_loop"
    assert both.resources.resources_per_worker == {"CPU": 2, "GPU": 1, "custom": 3}
    assert both.resources.use_gpu is True


def test_with_resources_cpus_bound_how_many_trials_run_at_once(storage, tmp_path, monkeypatch):
    active = str(tmp_path / "active")
    monkeypatch.setenv(ACTIVE_ENV, active)
    cpus = len(os.sched_getaffinity(0))
    grid = Tuner(tune.with_resources(tune_loop, {"cpu": cpus}),
                 param_space={"x": tune.grid_search([1, 2, 3])},
                 run_config=RunConfig(name="wide", storage_path=storage)).fit()
    assert grid.num_errors == 0 and max_running(active) == 1, "each trial takes every CPU"
    scaling = run_json(os.path.join(storage, "wide", "trial_00000"))["params"]["scaling_config"]
    assert scaling["fields"]["resources_per_worker"] == {"CPU": cpus}


def test_a_trial_asking_for_gpus_where_none_is_visible_is_refused_before_anything_is_written(storage):
    with pytest.raises(InsufficientResourcesError, match="no GPU is visible"):
        Tuner(tune.with_resources(tune_loop, {"gpu": 1}),
              run_config=RunConfig(name="gpu", storage_path=storage)).fit()
    assert not os.path.exists(os.path.join(storage, "gpu"))


def test_each_trial_sees_gpus_of_its_own(storage, tmp_path, monkeypatch):
    # Four GPUs, as the machine's count says (faked: trials are forked from this process and
    # inherit it); each trial takes two, so two run at once, each with a pair of its own.
    from unbroken.execution.engine import local
    from unbroken.tune import tuner

    monkeypatch.setattr(local, "visible_gpus", lambda: (4, "faked"))
    monkeypatch.setattr(tuner, "visible_gpus", lambda: (4, "faked"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    active = str(tmp_path / "active")
    monkeypatch.setenv(ACTIVE_ENV, active)
    grid = Tuner(tune.with_resources(gpu_env_loop, {"cpu": 0.1, "gpu": 2}),
                 param_space={"x": tune.grid_search(list(range(6)))},
                 run_config=RunConfig(name="gpus", storage_path=storage)).fit()
    assert grid.num_errors == 0, grid.errors
    seen = [r.metrics["gpus"] for r in grid]
    assert set(seen) <= {"0,1", "2,3"} and len(seen) == 6, seen
    assert max_running(active) <= 2


def test_gpu_slots_share_out_the_visible_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpus_per_trial(ScalingConfig(num_workers=3, use_gpu=True, resources_per_worker={"GPU": 0.5})) == 2
    assert gpus_per_trial(ScalingConfig(num_workers=2)) == 0
    slots = GpuSlots.of_machine(ScalingConfig(num_workers=2, use_gpu=True), lambda: 5)
    assert slots.trials == 2
    first, second = slots.take(), slots.take()
    assert (first, second, slots.take()) == (["0", "1"], ["2", "3"], None)
    slots.give(first)
    assert slots.take() == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    given = GpuSlots.of_machine(ScalingConfig(num_workers=1, use_gpu=True), lambda: 0)
    assert given.free == ["3", "5", "7"] and given.trials == 3
    assert GpuSlots.of_machine(ScalingConfig(num_workers=1), lambda: 1 / 0) is None, "not asked without GPUs"


CLASS_DRIVER = """
import sys
from tune_loops import Counter
from unbroken import tune
from unbroken.train import CheckpointConfig, RunConfig
grid = tune.Tuner(Counter, param_space={"x": tune.grid_search([1, 2])},
                  tune_config=tune.TuneConfig(max_concurrent_trials=1),
                  run_config=RunConfig(name=sys.argv[2], storage_path=sys.argv[1],
                                       checkpoint_config=CheckpointConfig(checkpoint_frequency=2))).fit()
print("DONE", [r.trial_status for r in grid])
"""


def class_rows(result) -> list[tuple]:
    return [(r["training_iteration"], r["it"], r["score"], r.get("checkpoint_dir_name")) for r in result.rows]


@pytest.mark.parametrize("blocked", ["trial_00000", "trial_00001"])  # state as a dict, as a file
def test_a_class_trainable_killed_mid_trial_resumes_from_its_checkpoint_exactly(storage, tmp_path, blocked):
    block = str(tmp_path / "block")
    os.makedirs(block)
    os.mkfifo(os.path.join(block, blocked))
    path = os.path.join(storage, "counter")
    driver = start_script(CLASS_DRIVER, storage, "counter", **{BLOCK_ENV: block})
    read_until(driver, f"{blocked} BLOCKING")  # step 3 reported, the checkpoint of step 2 committed
    driver.kill()
    driver.wait()
    driver.stdout.close()
    driver.stderr.close()
    os.remove(os.path.join(block, blocked))
    grid = Tuner.restore(path, Counter).fit()
    reference = run_script(CLASS_DRIVER, storage, "counter-reference")
    assert "DONE ['TERMINATED', 'TERMINATED']" in reference.stdout
    want = Tuner.restore(os.path.join(storage, "counter-reference")).get_results()
    assert [class_rows(r) for r in grid] == [class_rows(r) for r in want]
    x = 1 if blocked == "trial_00000" else 2
    assert [(it, score) for _, it, score, _ in class_rows(grid[x - 1])] == [(i, x * i) for i in range(1, 7)]
    assert [c for *_, c in class_rows(grid[x - 1]) if c] == ["checkpoint_000002", "checkpoint_000004",
                                                           "checkpoint_000006"], "every 2 steps, and at done"
    trial = run_json(os.path.join(path, blocked))
    assert [a["status"] for a in trial["attempts"]] == ["ABORTED", "FINISHED"]
    assert trial["attempts"][1]["resumed_from"] == "checkpoint_000002"


def test_with_parameters_reaches_a_class_trainable_s_setup(storage):
    grid = Tuner(tune.with_parameters(Counter, offset=100), param_space={"x": 1, "iterations": 2},
                 run_config=RunConfig(name="offset", storage_path=storage)).fit()
    assert [r["score"] for r in grid[0].rows] == [101, 102]
    with pytest.raises(TypeError, match="or a tune.Trainable subclass"):
        Tuner(Tuner)


AT_END = [(7, 7, 7, "checkpoint_000007"), (4, 4, 8, "checkpoint_000004")]  # each trial's last row


def _at_end_tuner(storage: str, name: str, stop, at_end: bool | None, max_failures: int = 0) -> Tuner:
    return Tuner(Counter, param_space={"x": tune.grid_search([1, 2]), "iterations": 20},
                 run_config=RunConfig(name=name, storage_path=storage, stop=stop,
                                      failure_config=FailureConfig(max_failures=max_failures),
                                      checkpoint_config=CheckpointConfig(checkpoint_at_end=at_end)))


def _saved_total(result) -> int:
    """The running total a class trial's final checkpoint holds (as a dict, or x=2's file)."""
    with result.checkpoint.as_directory() as directory:
        if os.path.exists(os.path.join(directory, "total.txt")):
            return int(open(os.path.join(directory, "total.txt")).read())
        return json.load(open(os.path.join(directory, ".trainable.json")))["state"]["total"]


def test_checkpoint_at_end_saves_the_report_a_stop_ends_a_class_trial_at(storage):
    grid = _at_end_tuner(storage, "at-end", {"score": 7}, True).fit()
    # x=1 meets score >= 7 at step 7, x=2 at step 4; the trial's last report gets the checkpoint
    assert [class_rows(r)[-1] for r in grid] == AT_END
    assert [c for r in grid for *_, c in class_rows(r)[:-1] if c] == [], "no other checkpoint"
    assert [_saved_total(r) for r in grid] == [7, 8]
    assert [r.checkpoint.path.rstrip("/").rsplit("/", 1)[1] for r in grid] == ["checkpoint_000007",
                                                                                "checkpoint_000004"]
    # a stopper's verdict too; without checkpoint_at_end=True, a stopped trial saves nothing
    stopped = _at_end_tuner(storage, "at-end-stopper", tune.stopper.MaximumIterationStopper(3), True).fit()
    assert [class_rows(r)[-1][3] for r in stopped] == ["checkpoint_000003"] * 2
    plain = _at_end_tuner(storage, "no-at-end", {"score": 7}, None).fit()
    assert [[c for *_, c in class_rows(r)] for r in plain] == [[None] * 7, [None] * 4]
    assert [r.checkpoint for r in plain] == [None, None]


def test_a_rank_killed_saving_the_checkpoint_at_end_retries_and_saves_it_once(storage, tmp_path, monkeypatch):
    log = str(tmp_path / "faults")
    monkeypatch.setenv("UNBROKEN_FAULT", "before_attach_staged:1:kill::once")
    monkeypatch.setenv("UNBROKEN_FAULT_LOG", log)
    grid = _at_end_tuner(storage, "at-end-killed", {"score": 7}, True, max_failures=1).fit()
    assert open(log).read().split()[0] == "before_attach_staged", "the rank was killed there"
    assert [class_rows(r)[-1] for r in grid] == AT_END
    assert [[row[0] for row in class_rows(r)] for r in grid] == [list(range(1, 8)), list(range(1, 5))]
    assert [_saved_total(r) for r in grid] == [7, 8]
    attempts = [[a["status"] for a in run_json(r.path)["attempts"]] for r in grid]
    assert sorted(attempts) == [["ERRORED", "FINISHED"], ["FINISHED"]], attempts
