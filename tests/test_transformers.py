"""unbroken.train.huggingface.transformers with the real Transformers Trainer: 2 workers on gloo,
a run whose worker or driver is SIGKILLed resumes (by running it again, by restore in a new
process) and ends exactly as the uninterrupted run; stop, checkpoint retention and sweeps work
through the report callback."""

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from conftest import TESTS, driver_env, run_json, run_script  # noqa: E402
from integration_checks import RESTORE, assert_equal_tensors, check_resumed_like, kill_driver_at  # noqa: E402
from transformers_loops import Numbered, final_weights, shard_loop, transformers_loop  # noqa: E402
from unbroken import tune  # noqa: E402
from unbroken.errors import UnsupportedAPIError  # noqa: E402
from unbroken.train import (  # noqa: E402
    CheckpointConfig,
    Result,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
)
from unbroken.train.torch import TorchTrainer  # noqa: E402

SAVE_STEPS = 3  # max_steps 12: iterations 1-4 at steps 3, 6, 9, 12 (an epoch is 8 steps)
COLUMNS = ["training_iteration", "step", "epoch", "loss", "grad_norm", "learning_rate", "eval_loss"]


def trainer(storage, name, **config):
    return TorchTrainer(transformers_loop, train_loop_config=config,
                        scaling_config=ScalingConfig(num_workers=2),
                        run_config=RunConfig(name=name, storage_path=storage))


def check_same_end(result, reference) -> None:
    """Weights, optimizer and scheduler state are those of the reference, bit for bit."""
    assert_equal_tensors(final_weights(result), final_weights(reference))
    for name in ("optimizer.pt", "scheduler.pt"):
        got, want = (torch.load(os.path.join(r.checkpoint.path, "checkpoint", name), weights_only=False)
                     for r in (result, reference))
        assert_equal_tensors({name: got}, {name: want})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run."""
    d = tmp_path_factory.mktemp("reference")
    return trainer(str(d), "reference", output_dir=str(d / "out")).fit()


def test_uninterrupted_run_reports_each_save_with_the_transformers_checkpoint(reference):
    df = reference.metrics_dataframe
    assert list(df["training_iteration"]) == [1, 2, 3, 4] and list(df["step"]) == [3, 6, 9, 12]
    assert {"loss", "eval_loss", "learning_rate", "epoch"} <= set(df.columns)
    assert list(df["learning_rate"]) == sorted(df["learning_rate"], reverse=True), "the schedule ran"
    files = sorted(os.listdir(os.path.join(reference.checkpoint.path, "checkpoint")))
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json",
                 "rng_state_0.pth", "rng_state_1.pth"):
        assert name in files, (name, files)  # Ray's layout: the Trainer's checkpoint in checkpoint/


def test_killed_worker_then_the_same_run_again_continues_exactly(storage, reference, tmp_path):
    # Each rank with its own output_dir, as on separate nodes: rank 1's generator file comes from
    # rank 1's directory.
    config = {"output_dir": str(tmp_path / "out"), "per_rank_dir": True, "kill_at": [8, 1, 1]}
    with pytest.raises(TrainingFailedError, match="SIGKILL"):
        trainer(storage, "worker-killed", **config).fit()  # rank 1 dies beginning step 8
    assert Result.from_path(os.path.join(storage, "worker-killed")).metrics["training_iteration"] == 2

    result = trainer(storage, "worker-killed", **config).fit()  # what running the script again does
    # Resumed from step 6, in the middle of the first epoch.
    assert check_resumed_like(result, reference, COLUMNS, SAVE_STEPS) == 2
    check_same_end(result, reference)


def test_killed_driver_then_restore_in_a_new_process_continues_exactly(storage, reference, tmp_path):
    config = {"output_dir": str(tmp_path / "out"), "echo": True, "block_at": [6, str(tmp_path / "block")]}
    # Rank 0 prints "SAVED 6" after it reported the save of step 6, and blocks: the driver has
    # recorded step 3's report by then, and may record step 6's before it dies.
    kill_driver_at("transformers_loops", "transformers_loop", storage, "driver-killed", config, "SAVED 6")
    path = os.path.join(storage, "driver-killed")
    assert run_json(path)["status"] == "RUNNING"

    out = run_script(RESTORE, path)
    assert "DONE 4 2" in out.stdout
    result = Result.from_path(path)
    assert check_resumed_like(result, reference, COLUMNS, SAVE_STEPS) in (1, 2)
    check_same_end(result, reference)


def test_stop_retention_and_a_sweep_over_a_transformers_trainer(storage, tmp_path):
    base = TorchTrainer(transformers_loop, train_loop_config={"output_dir": str(tmp_path / "out"),
                                                              "per_rank_dir": True},
                        scaling_config=ScalingConfig(num_workers=2))
    grid = tune.Tuner(
        base, param_space={"train_loop_config": {"lr": tune.grid_search([1e-3, 5e-3])}},
        tune_config=tune.TuneConfig(metric="eval_loss", mode="min", max_concurrent_trials=1),
        run_config=RunConfig(name="sweep", storage_path=storage, stop={"step": 9},
                             checkpoint_config=CheckpointConfig(num_to_keep=1,
                                                                checkpoint_score_attribute="eval_loss",
                                                                checkpoint_score_order="min"))).fit()
    assert len(grid) == 2 and grid.num_terminated == 2 and grid.num_errors == 0
    for result in grid:
        df = result.metrics_dataframe
        assert list(df["step"]) == [3, 6, 9], "stopped at step 9 of 12"
        best = int(df.loc[df["eval_loss"].idxmin(), "training_iteration"])
        kept = {int(n.rsplit("_", 1)[1]) for n in os.listdir(result.path) if n.startswith("checkpoint_")}
        assert kept == {best, 3}, "the best by eval_loss, and the latest"
    assert {r.config["train_loop_config"]["lr"] for r in grid} == {1e-3, 5e-3}
    assert grid.get_best_result().metrics["eval_loss"] == min(r.metrics["eval_loss"] for r in grid)


def check_prepare_trainer(config: dict) -> None:
    """prepare_trainer refuses a Trainer that sees another world size and warns about setups
    that would report nothing or not resume where the run stopped."""
    import types
    import warnings

    import transformers

    from transformers_loops import Sequences, tiny_bert
    from unbroken import train
    from unbroken.train.huggingface.transformers import RayTrainReportCallback, prepare_trainer

    seen = {}
    for name, kwargs in [("plain", {}), ("no_save", {"save_strategy": "no"}),
                         ("no_skip", {"ignore_data_skip": True})]:
        args = transformers.TrainingArguments(output_dir=config["output_dir"], use_cpu=True, report_to=[],
                                              **kwargs)
        t = transformers.Trainer(model=tiny_bert(), args=args, train_dataset=Sequences(8, 0))
        if name != "plain":
            t.add_callback(RayTrainReportCallback())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            seen[name] = [prepare_trainer(t) is t, [str(w.message) for w in caught]]
    lone = types.SimpleNamespace(args=types.SimpleNamespace(world_size=1))
    try:
        prepare_trainer(lone)
    except RuntimeError as e:
        seen["lone"] = str(e)
    # The world-size refusal says what is wrong: TrainingArguments on a CPU without use_cpu=True,
    # built here in the worker; or arguments set up without the run's environment (as when built
    # in the driver), with use_cpu=True.
    run_env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
               if k in os.environ}
    outside = transformers.TrainingArguments(output_dir=config["output_dir"], use_cpu=True, report_to=[])
    outside.world_size  # noqa: B018 (set up without the run's environment)
    os.environ.update(run_env)
    inside_no_cpu = transformers.TrainingArguments(output_dir=config["output_dir"], report_to=[])
    for name, args in [("outside", outside), ("no_use_cpu", inside_no_cpu)]:
        try:
            prepare_trainer(transformers.Trainer(model=tiny_bert(), args=args, train_dataset=Sequences(8, 0)))
        except RuntimeError as e:
            seen[name] = str(e)
    train.report(seen)


def test_prepare_trainer_checks_the_world_size_and_warns(storage, tmp_path):
    seen = TorchTrainer(check_prepare_trainer, train_loop_config={"output_dir": str(tmp_path / "out")},
                        scaling_config=ScalingConfig(num_workers=2),
                        run_config=RunConfig(name="prepare", storage_path=storage)).fit().metrics
    assert seen["plain"][0] and "no RayTrainReportCallback" in seen["plain"][1][0]
    assert seen["no_save"][0] and "save_strategy='no'" in seen["no_save"][1][0]
    assert seen["no_skip"][0] and "ignore_data_skip=True" in seen["no_skip"][1][0]
    assert "sees 1 process(es) but the run has 2" in seen["lone"]
    assert "inside train_loop_per_worker" in seen["outside"] and "use_cpu" not in seen["outside"]
    if not torch.cuda.is_available():
        assert "use_cpu=True" in seen["no_use_cpu"]
        assert "inside train_loop_per_worker" not in seen["no_use_cpu"]


def test_one_worker_trains_as_in_ray(storage, tmp_path):
    # Ray's default ScalingConfig: one worker, with RANK, WORLD_SIZE and LOCAL_RANK set, so the
    # Trainer (accelerate) joins the process group TorchTrainer set up.
    result = TorchTrainer(transformers_loop,
                          train_loop_config={"output_dir": str(tmp_path / "out"), "max_steps": 3},
                          run_config=RunConfig(name="one", storage_path=storage)).fit()
    assert list(result.metrics_dataframe["step"]) == [3]


def test_dataset_shards_are_not_split_a_second_time(storage, tmp_path):
    # get_dataset_shard gave each rank its part already; the Trainer's own sharding must not split
    # that part again: together the ranks see each sample once, in training (one epoch: 64
    # samples, 2 ranks, batch 4) and in evaluation.
    result = TorchTrainer(shard_loop, train_loop_config={"out": str(tmp_path), "steps": 8},
                          scaling_config=ScalingConfig(num_workers=2),
                          datasets={"train": Numbered(64, 1, "train"), "eval": Numbered(16, 2, "eval")},
                          run_config=RunConfig(name="shards", storage_path=storage)).fit()
    fetched = [json.load(open(tmp_path / f"fetched{rank}.json")) for rank in range(2)]
    for split, n in [("train", 64), ("eval", 16)]:
        assert [len(set(f[split])) for f in fetched] == [n // 2] * 2, split
        assert sorted(set(fetched[0][split]) | set(fetched[1][split])) == list(range(n)), split
    refused = result.metrics["refused"]
    assert refused.startswith("UnsupportedOptionError") and "prepare_trainer(trainer)" in refused


def test_ray_huggingface_names_unbroken_does_not_provide_say_what_instead():
    with pytest.raises(UnsupportedAPIError, match="Hint") as refused:
        from unbroken.train.huggingface import TransformersTrainer  # noqa: F401
    assert "unbroken.train.huggingface.transformers" in str(refused.value)


def test_missing_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "unbroken.train.huggingface.transformers")
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'unbroken\[transformers\]'"):
        importlib.import_module("unbroken.train.huggingface.transformers")


@pytest.mark.slow
def test_the_example_runs_and_resumes_exactly(tmp_path):
    example = os.path.join(TESTS, "..", "examples", "transformers_classification.py")
    out = subprocess.run([sys.executable, example, "--storage", str(tmp_path)], env=driver_env(),
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "final weights identical to the uninterrupted run: True" in out.stdout
