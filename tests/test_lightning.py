"""unbroken.train.lightning with the real PyTorch Lightning: 2 workers on gloo, a run whose worker
or driver is SIGKILLed resumes (by restore, by running the script again) and ends exactly as the
uninterrupted run; stop, checkpoint retention and sweeps work through the report callback."""

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lightning")

from conftest import TESTS, driver_env, run_json, run_script  # noqa: E402
from integration_checks import (  # noqa: E402
    DRIVER,
    assert_equal_tensors,
    check_resumed_like,
    kill_driver_at,
)
from lightning_loops import lightning_loop, no_strategy_loop, shard_loop  # noqa: E402
from unbroken import tune  # noqa: E402
from unbroken.errors import TrainingInterruptedError, UnsupportedAPIError  # noqa: E402
from unbroken.train import (  # noqa: E402
    CheckpointConfig,
    Result,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
)
from unbroken.train.lightning import RayTrainReportCallback  # noqa: E402
from unbroken.train.torch import TorchTrainer  # noqa: E402

EPOCHS, STEPS_PER_EPOCH = 4, 4  # 64 samples, batch 8, 2 ranks
COLUMNS = ["training_iteration", "epoch", "step", "loss", "val_loss", "lr"]


def fit(storage, name, **config):
    return TorchTrainer(lightning_loop, train_loop_config={"epochs": EPOCHS, **config},
                        scaling_config=ScalingConfig(num_workers=2),
                        run_config=RunConfig(name=name, storage_path=storage)).fit()


def lightning_checkpoint(result) -> dict:
    with result.checkpoint.as_directory() as d:
        return torch.load(os.path.join(d, RayTrainReportCallback.CHECKPOINT_NAME), weights_only=False)


def check_same_end(result, reference) -> None:
    """Weights, optimizer and scheduler state and loop counters are those of the reference."""
    got, want = lightning_checkpoint(result), lightning_checkpoint(reference)
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "global_step", "epoch"):
        assert_equal_tensors({key: got[key]}, {key: want[key]})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run."""
    return fit(str(tmp_path_factory.mktemp("reference")), "reference")


def test_uninterrupted_run_reports_each_epoch_with_a_lightning_checkpoint(reference):
    df = reference.metrics_dataframe
    assert list(df["training_iteration"]) == [1, 2, 3, 4] and list(df["epoch"]) == [0, 1, 2, 3]
    assert list(df["step"]) == [4, 8, 12, 16]
    assert {"loss", "val_loss", "lr"} <= set(df.columns)
    assert df["lr"].iloc[-1] == pytest.approx(0.02 * 0.7), "the StepLR schedule ran"
    files = sorted(f for f in os.listdir(reference.checkpoint.path) if not f.startswith("."))
    assert files == ["checkpoint.ckpt", "rng_rank0.pt", "rng_rank1.pt"]  # Ray's layout + generators
    assert lightning_checkpoint(reference)["global_step"] == 16


def test_killed_worker_then_restore_continues_exactly(storage, reference):
    with pytest.raises(TrainingFailedError, match="SIGKILL"):
        fit(storage, "worker-killed", kill_at=[2, 1, 1])  # rank 1 dies at the start of epoch 2
    path = os.path.join(storage, "worker-killed")
    assert Result.from_path(path).metrics["training_iteration"] == 2

    result = TorchTrainer.restore(path).fit()
    assert check_resumed_like(result, reference, COLUMNS, STEPS_PER_EPOCH) == 2
    check_same_end(result, reference)


def test_preempted_run_checkpoints_at_the_epoch_end_and_restores_exactly(storage, reference):
    # SIGTERM while rank 0 starts epoch 1: the driver asks for a checkpoint at the first report
    # it has not answered yet (epoch 0's, when rank 1 has not sent it, else epoch 1's or 2's);
    # the callback attaches one to every report, and the workers stop after it.
    with pytest.raises(TrainingInterruptedError):
        fit(storage, "preempted", preempt_at=[1, 1, 0])
    path = os.path.join(storage, "preempted")
    assert run_json(path)["status"] == "INTERRUPTED"
    result = TorchTrainer.restore(path).fit()
    assert check_resumed_like(result, reference, COLUMNS, STEPS_PER_EPOCH) in (1, 2, 3)
    check_same_end(result, reference)


def test_killed_driver_then_the_same_script_again_continues_exactly(storage, reference, tmp_path):
    config = {"epochs": EPOCHS, "echo": True, "block_at": [1, str(tmp_path / "block")]}
    # Rank 0 prints "REPORTED 1" after it sent epoch 1's report, and blocks: the driver has
    # recorded epoch 0 (iteration 1) by then, and may record epoch 1 before it dies.
    kill_driver_at("lightning_loops", "lightning_loop", storage, "driver-killed", config, "REPORTED 1")
    path = os.path.join(storage, "driver-killed")
    assert run_json(path)["status"] == "RUNNING"

    out = run_script(DRIVER.format(module="lightning_loops", loop="lightning_loop"), storage,
                     "driver-killed", json.dumps(config))
    assert f"DONE {EPOCHS} 2" in out.stdout
    result = Result.from_path(path)
    assert check_resumed_like(result, reference, COLUMNS, STEPS_PER_EPOCH) in (1, 2)
    check_same_end(result, reference)


def test_stop_retention_and_a_sweep_over_a_lightning_trainer(storage):
    trainer = TorchTrainer(lightning_loop, train_loop_config={"epochs": 6},
                           scaling_config=ScalingConfig(num_workers=2))
    grid = tune.Tuner(
        trainer, param_space={"train_loop_config": {"lr": tune.grid_search([0.01, 0.03])}},
        tune_config=tune.TuneConfig(metric="val_loss", mode="min", max_concurrent_trials=1),
        run_config=RunConfig(name="sweep", storage_path=storage, stop={"training_iteration": 4},
                             checkpoint_config=CheckpointConfig(num_to_keep=2,
                                                                checkpoint_score_attribute="val_loss",
                                                                checkpoint_score_order="min"))).fit()
    assert len(grid) == 2 and grid.num_terminated == 2 and grid.num_errors == 0
    for result in grid:
        df = result.metrics_dataframe
        assert list(df["training_iteration"]) == [1, 2, 3, 4], "stopped after iteration 4 of 6"
        assert list(df["step"]) == [4, 8, 12, 16]
        best_two = set(df.nsmallest(2, "val_loss")["training_iteration"])
        kept = {int(n.rsplit("_", 1)[1]) for n in os.listdir(result.path) if n.startswith("checkpoint_")}
        assert kept == best_two | {4}, "the two best by val_loss, and the latest"
        assert [m["val_loss"] for _, m in result.best_checkpoints] == sorted(df["val_loss"][df[
            "training_iteration"].isin(kept)], reverse=True), "Ray's order: the best (lowest) last"
    best = grid.get_best_result()
    assert best.metrics["val_loss"] == min(r.metrics["val_loss"] for r in grid)
    assert {r.config["train_loop_config"]["lr"] for r in grid} == {0.01, 0.03}


def check_prepare_trainer(config: dict) -> None:
    """prepare_trainer accepts unbroken's strategies and refuses what would not run on the workers."""
    from unbroken import train
    from unbroken.train.lightning import (
        RayDDPStrategy,
        RayFSDPStrategy,
        RayLightningEnvironment,
        pl,
        prepare_trainer,
    )

    def trainer(**kwargs):
        return pl.Trainer(accelerator="cpu", devices="auto", logger=False, enable_progress_bar=False,
                          enable_model_summary=False, enable_checkpointing=False, **kwargs)

    environment = RayLightningEnvironment()
    seen = {"world_size": environment.world_size(), "rank": environment.global_rank()}
    for name, strategy in [("ddp", RayDDPStrategy()), ("fsdp", RayFSDPStrategy())]:
        t = trainer(strategy=strategy, plugins=[RayLightningEnvironment()])
        seen[name] = prepare_trainer(t) is t
        seen[f"{name}_sampler"] = t.strategy.distributed_sampler_kwargs
    for name, kwargs in [("plain_ddp", {"strategy": pl.strategies.DDPStrategy()}),
                         ("other_env", {"strategy": RayDDPStrategy(),
                                        "plugins": [pl.plugins.environments.LightningEnvironment()]})]:
        try:
            prepare_trainer(trainer(**kwargs))
            seen[name] = "accepted"
        except RuntimeError as e:
            seen[name] = str(e)
    train.report(seen)


def test_prepare_trainer_and_environment(storage):
    result = TorchTrainer(check_prepare_trainer, scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(name="prepare", storage_path=storage)).fit()
    seen = result.metrics
    assert seen["world_size"] == 2 and seen["rank"] == 0 and seen["ddp"] and seen["fsdp"]
    assert seen["ddp_sampler"] == seen["fsdp_sampler"] == {"num_replicas": 2, "rank": 0}
    assert "RayDDPStrategy" in seen["plain_ddp"] and "RayLightningEnvironment" in seen["other_env"]


def test_dataset_shards_are_not_split_a_second_time(storage, tmp_path):
    # get_dataset_shard gave each rank its part already; Lightning's distributed sampler must not
    # split that part again: together the ranks see each sample once an epoch.
    TorchTrainer(shard_loop, train_loop_config={"out": str(tmp_path)},
                 scaling_config=ScalingConfig(num_workers=2),
                 datasets={"train": list(range(32)), "val": list(range(100, 116))},
                 run_config=RunConfig(name="shards", storage_path=storage)).fit()
    seen = [json.load(open(tmp_path / f"seen{rank}.json")) for rank in range(2)]
    for split, everything in [("train", range(32)), ("val", range(100, 116))]:
        assert [len(set(s[split])) for s in seen] == [len(everything) // 2] * 2, split
        assert sorted(seen[0][split] + seen[1][split]) == list(everything), split


def test_the_report_callback_without_the_ray_strategy(storage):
    # Ray's snippet (callbacks=[RayTrainReportCallback()], no strategy) on 2 workers: each rank's
    # Trainer is rank 0 of its own, and the generator files are named by the run's rank.
    def fit(name, **config):
        return TorchTrainer(no_strategy_loop, train_loop_config=config,
                            scaling_config=ScalingConfig(num_workers=2),
                            run_config=RunConfig(name=name, storage_path=storage)).fit()

    result = fit("alike")
    files = sorted(f for f in os.listdir(result.checkpoint.path) if not f.startswith("."))
    assert files == ["checkpoint.ckpt", "rng_rank0.pt", "rng_rank1.pt"]
    # Ranks whose models differ cannot share checkpoint.ckpt: the error says what to change.
    with pytest.raises(TrainingFailedError, match="RayDDPStrategy") as failed:
        fit("apart", differ=True)
    assert "rng_rank" not in str(failed.value) and "checkpoint.ckpt" in str(failed.value)


@pytest.mark.parametrize("name,hint", [("RayDeepSpeedStrategy", "RayFSDPStrategy"),
                                       ("LightningTrainer", "TorchTrainer")])
def test_ray_lightning_names_unbroken_does_not_provide_say_what_instead(name, hint):
    with pytest.raises(UnsupportedAPIError, match="Hint") as refused:
        exec(f"from unbroken.train.lightning import {name}")
    assert hint in str(refused.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FSDP on this torch needs an accelerator")
def test_fsdp_trains_and_resumes(storage):
    result = TorchTrainer(lightning_loop, train_loop_config={"epochs": 2, "fsdp": True},
                          scaling_config=ScalingConfig(num_workers=2, use_gpu=True),
                          run_config=RunConfig(name="fsdp", storage_path=storage)).fit()
    assert list(result.metrics_dataframe["step"]) == [4, 8]


def test_missing_lightning_names_the_extra(monkeypatch):
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    monkeypatch.delitem(sys.modules, "unbroken.train.lightning")
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'unbroken\[lightning\]'"):
        importlib.import_module("unbroken.train.lightning")


def test_unbroken_train_imports_neither_framework():
    out = run_script("import sys, unbroken.train, unbroken.train.torch, unbroken.train.huggingface\n"
                     "print(sorted(m for m in ('lightning', 'pytorch_lightning', 'transformers') "
                     "if m in sys.modules))")
    assert out.stdout.strip() == "[]"



@pytest.mark.slow
def test_the_example_runs_and_resumes_exactly(tmp_path):
    example = os.path.join(TESTS, "..", "examples", "lightning_regression.py")
    out = subprocess.run([sys.executable, example, "--storage", str(tmp_path)], env=driver_env(),
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "final weights identical to the uninterrupted run: True" in out.stdout


def test_without_the_lightning_package_pytorch_lightning_is_used(monkeypatch):
    pytest.importorskip("pytorch_lightning")
    for name in ("lightning", "lightning.pytorch"):
        monkeypatch.setitem(sys.modules, name, None)  # only the older spelling is installed
    monkeypatch.delitem(sys.modules, "unbroken.train.lightning")
    module = importlib.import_module("unbroken.train.lightning")
    assert module.pl.__name__ == "pytorch_lightning"
    assert issubclass(module.RayDDPStrategy, module.pl.strategies.DDPStrategy)
    assert issubclass(module.RayTrainReportCallback, module.pl.Callback)
