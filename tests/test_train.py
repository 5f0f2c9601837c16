"""fit() on real worker processes: results, the worker API, the storage layout, retention."""

import json
import os

import pytest
import torch

from loops import linear_loop, simple_loop
from unbroken import train
from unbroken.errors import ReportMismatchError
from unbroken.train import (
    BaseTrainer,
    CheckpointConfig,
    DataParallelTrainer,
    FailureConfig,
    Result,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
)
from unbroken.train.torch import TorchTrainer, prepare_data_loader, prepare_model


def two_workers():
    return ScalingConfig(num_workers=2)


def test_fit_returns_result_with_metrics_checkpoint_and_history(storage):
    result = TorchTrainer(linear_loop, train_loop_config={"iterations": 6, "ckpt_every": 2},
                          scaling_config=two_workers(),
                          run_config=RunConfig(name="basic", storage_path=storage)).fit()
    assert result.error is None
    assert result.path == os.path.join(storage, "basic")
    assert result.metrics["training_iteration"] == 6 and result.metrics["it"] == 6
    assert result.metrics["attempt"] == 1
    assert result.checkpoint.path == os.path.join(storage, "basic", "checkpoint_000006")
    df = result.metrics_dataframe
    assert list(df["training_iteration"]) == [1, 2, 3, 4, 5, 6]
    assert list(df["checkpoint_dir_name"].fillna("")) == ["", "checkpoint_000002", "",
                                                          "checkpoint_000004", "", "checkpoint_000006"]
    assert df["time_total_s"].is_monotonic_increasing
    # The loss went down: a real model trained across two DDP workers.
    assert df["loss"].iloc[-1] < df["loss"].iloc[0]


def context_loop(config):
    ctx = train.get_context()
    shard = train.get_dataset_shard("train")
    info = {"rank": ctx.get_world_rank(), "world": ctx.get_world_size(),
            "local_rank": ctx.get_local_rank(), "node": ctx.get_node_rank(),
            "name": ctx.get_experiment_name(), "attempt": ctx.get_attempt(),
            "storage": ctx.get_storage_path(), "shard": list(shard),
            "dist": torch.distributed.is_initialized(), "env_rank": os.environ["RANK"],
            # prepare_data_loader on the shard: it shares out the dataset the shard was cut from,
            # instead of splitting this rank's part a second time.
            "loaded": [int(v) for batch in prepare_data_loader(
                torch.utils.data.DataLoader(shard, batch_size=2, shuffle=True)) for v in batch]}
    with open(os.path.join(config["out"], f"rank{info['rank']}.json"), "w") as f:
        json.dump(info, f)
    train.report({"x": 1})


@pytest.mark.parametrize("trainer_cls,dist", [(TorchTrainer, True), (DataParallelTrainer, False)])
def test_context_and_dataset_shards(storage, tmp_path, trainer_cls, dist):
    trainer_cls(context_loop, train_loop_config={"out": str(tmp_path)}, scaling_config=two_workers(),
                datasets={"train": list(range(10))},
                run_config=RunConfig(name="ctx", storage_path=storage)).fit()
    infos = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    for rank, info in enumerate(infos):
        assert info["rank"] == rank and info["world"] == 2 and info["local_rank"] == rank
        assert info["node"] == 0 and info["name"] == "ctx" and info["attempt"] == 1
        assert info["storage"] == storage and info["env_rank"] == str(rank)
        assert info["dist"] is dist
    assert sorted(infos[0]["shard"] + infos[1]["shard"]) == list(range(10))
    assert not set(infos[0]["shard"]) & set(infos[1]["shard"])
    assert sorted(infos[0]["loaded"] + infos[1]["loaded"]) == list(range(10)), "each sample once an epoch"


def one_worker_loop(config):
    import torch.distributed as dist

    total = torch.tensor([3.0])
    dist.all_reduce(total)
    dist.barrier()
    model = prepare_model(torch.nn.Linear(1, 1))
    train.report({"sum": total.item(), "rank": dist.get_rank(), "world": dist.get_world_size(),
                  "backend": dist.get_backend(), "model": type(model).__name__,
                  "master": [os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")]})


def test_a_stop_at_a_known_iteration_begins_no_iteration_past_it(storage, tmp_path):
    """RunConfig(stop={"training_iteration": 3}): each rank waits for the verdict on report 3
    and stops there, instead of beginning iteration 4 before it learns it stops."""
    ran = str(tmp_path / "ran")
    result = DataParallelTrainer(simple_loop, train_loop_config={"iterations": 8, "ran": ran},
                                 scaling_config=ScalingConfig(num_workers=2),
                                 run_config=RunConfig(name="stopped", storage_path=storage,
                                                      stop={"training_iteration": 3})).fit()
    assert result.metrics_dataframe["training_iteration"].tolist() == [1, 2, 3]
    assert sorted(open(ran).read().split()) == ["0:1", "0:2", "0:3", "1:1", "1:2", "1:3"]


def test_one_worker_has_a_process_group_of_one(storage):
    # Ray's default ScalingConfig: one worker, which still has torch.distributed to call.
    result = TorchTrainer(one_worker_loop, run_config=RunConfig(name="one", storage_path=storage)).fit()
    metrics = result.metrics
    assert (metrics["sum"], metrics["rank"], metrics["world"], metrics["backend"]) == (3.0, 0, 1, "gloo")
    assert metrics["model"] == "Linear", "as in Ray, prepare_model wraps in DDP only with several workers"
    assert metrics["master"][0] and int(metrics["master"][1]) > 0


def loader_loop(config):
    ds = torch.utils.data.TensorDataset(torch.arange(20).float().unsqueeze(1))
    loader = prepare_data_loader(torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True))
    model = prepare_model(torch.nn.Linear(1, 1))
    seen = []
    for _epoch in range(2):
        epoch_seen = [int(v) for (batch,) in loader for v in batch.flatten()]
        seen.append(epoch_seen)
    rank = train.get_context().get_world_rank()
    with open(os.path.join(config["out"], f"seen{rank}.json"), "w") as f:
        json.dump({"seen": seen, "ddp": type(model).__name__}, f)
    train.report({"n": len(seen[0])})


def test_prepare_model_and_data_loader_shard_the_data(storage, tmp_path):
    TorchTrainer(loader_loop, train_loop_config={"out": str(tmp_path)}, scaling_config=two_workers(),
                 run_config=RunConfig(name="loader", storage_path=storage)).fit()
    seen = [json.load(open(tmp_path / f"seen{r}.json")) for r in range(2)]
    assert all(s["ddp"] == "DistributedDataParallel" for s in seen)
    for epoch in range(2):
        both = seen[0]["seen"][epoch] + seen[1]["seen"][epoch]
        assert sorted(both) == list(range(20)), "each sample once per epoch across ranks"
    assert seen[0]["seen"][0] != seen[0]["seen"][1], "the sampler reshuffles each epoch"


class CountingTrainer(BaseTrainer):
    """A BaseTrainer subclass: its own arguments, its own training_loop."""

    def __init__(self, steps: int, *, run_config=None, scaling_config=None):
        super().__init__(run_config=run_config, scaling_config=scaling_config)
        self.steps = steps

    def training_loop(self):
        for i in range(self.steps):
            train.report({"step": i})


def test_base_trainer_subclass_runs_training_loop(storage):
    result = CountingTrainer(3, run_config=RunConfig(name="count", storage_path=storage)).fit()
    assert list(result.metrics_dataframe["step"]) == [0, 1, 2]
    assert BaseTrainer.restore(result.path).steps == 3


def test_storage_layout_and_commit_protocol(storage):
    result = DataParallelTrainer(simple_loop, train_loop_config={"iterations": 3, "per_rank": True},
                                 scaling_config=two_workers(),
                                 run_config=RunConfig(name="layout", storage_path=storage)).fit()
    run = result.path
    entries = sorted(os.listdir(run))
    assert entries == [".unbroken", "checkpoint_000001", "checkpoint_000002", "checkpoint_000003",
                       "params.json", "progress.csv", "result.json"]
    # Every argument is plain data or importable by name: nothing is pickled.
    assert sorted(os.listdir(os.path.join(run, ".unbroken"))) == ["lease.lock", "run.json", "run.prev.json"]
    manifest = json.load(open(os.path.join(run, ".unbroken", "run.json")))
    previous = json.load(open(os.path.join(run, ".unbroken", "run.prev.json")))
    assert manifest["generation"] == previous["generation"] + 1
    assert manifest["status"] == "FINISHED" and manifest["latest_checkpoint"] == "checkpoint_000003"
    assert manifest["schema_version"] == 2 and manifest["trainer_class"].endswith("DataParallelTrainer")
    assert manifest["params"]["train_loop_per_worker"] == {"__ref__": "loops:simple_loop"}
    # Each rank wrote its own file; they merged into one checkpoint with a marker listing both.
    ckpt = os.path.join(run, "checkpoint_000002")
    assert sorted(os.listdir(ckpt)) == [".checkpoint.json", "rank0.txt", "rank1.txt"]
    marker = json.load(open(os.path.join(ckpt, ".checkpoint.json")))
    assert [f["path"] for f in marker["files"]] == ["rank0.txt", "rank1.txt"]
    assert [f["rank"] for f in marker["files"]] == [0, 1]
    assert marker["iteration"] == 2 and marker["metrics"]["score"] == 2
    rows = [json.loads(line) for line in open(os.path.join(run, "result.json"))]
    assert [r["training_iteration"] for r in rows] == [1, 2, 3] and {r["attempt"] for r in rows} == {1}
    assert json.load(open(os.path.join(run, "params.json"))) == {"iterations": 3, "per_rank": True}
    assert open(os.path.join(run, "progress.csv")).readline().startswith("score,it,training_iteration")


def test_retention_keeps_num_to_keep_latest(storage):
    result = DataParallelTrainer(simple_loop, train_loop_config={"iterations": 5},
                                 run_config=RunConfig(name="keep", storage_path=storage,
                                                      checkpoint_config=CheckpointConfig(num_to_keep=2))
                                 ).fit()
    assert sorted(n for n in os.listdir(result.path) if n.startswith("checkpoint")) == [
        "checkpoint_000004", "checkpoint_000005"]


def test_retention_best_k_by_score_never_drops_latest(storage):
    scores = [5, 1, 9, 2, 3]
    config = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="score",
                              checkpoint_score_order="max")
    result = DataParallelTrainer(simple_loop, train_loop_config={"iterations": 5, "score": scores},
                                 run_config=RunConfig(name="best", storage_path=storage,
                                                      checkpoint_config=config)).fit()
    kept = sorted(n for n in os.listdir(result.path) if n.startswith("checkpoint"))
    # Best two by score are iterations 3 (9) and 1 (5); the latest (5) is always kept.
    assert kept == ["checkpoint_000001", "checkpoint_000003", "checkpoint_000005"]
    # Ray's order: the best last (a ported `best_checkpoints[-1]` is the best).
    assert [c.path.rsplit("/", 1)[1] for c, _ in result.best_checkpoints][-2:] == [
        "checkpoint_000001", "checkpoint_000003"]
    assert result.checkpoint.path.endswith("checkpoint_000005")


def bad_metrics_loop(config):
    train.report({"loss": torch.tensor([1.0, 2.0])})


def test_metrics_that_are_not_json_fail_clearly(storage):
    with pytest.raises(TrainingFailedError) as info:
        DataParallelTrainer(bad_metrics_loop,
                            run_config=RunConfig(name="badmetrics", storage_path=storage)).fit()
    assert isinstance(info.value.__cause__, TypeError)
    assert "'loss'" in str(info.value.__cause__) and "not JSON-serializable" in str(info.value.__cause__)


def uneven_loop(config):
    n = 3 if train.get_context().get_world_rank() == 0 else 2
    for i in range(n):
        train.report({"i": i})


def test_report_called_by_some_ranks_only(storage):
    with pytest.raises(TrainingFailedError) as info:
        DataParallelTrainer(uneven_loop, scaling_config=two_workers(),
                            run_config=RunConfig(name="uneven", storage_path=storage,
                                                 failure_config=None)).fit()
    assert isinstance(info.value.__cause__, ReportMismatchError)
    assert "collective" in str(info.value.__cause__)


def test_result_from_path_reads_a_finished_run(storage):
    result = DataParallelTrainer(simple_loop, train_loop_config={"iterations": 3},
                                 run_config=RunConfig(name="frompath", storage_path=storage)).fit()
    again = Result.from_path(result.path)
    assert again.metrics == result.metrics
    assert again.checkpoint == result.checkpoint
    assert list(again.metrics_dataframe["training_iteration"]) == [1, 2, 3]
    import pathlib

    from unbroken.errors import RunNotFoundError

    assert Result.from_path(pathlib.Path(result.path)).metrics == result.metrics  # a PathLike, as in Ray
    with pytest.raises(RunNotFoundError):  # not a TypeError from the hint's check of the path
        Result.from_path(pathlib.Path("no-such-run"))


def test_ray_engine_without_ray_installed_is_refused_before_anything_is_written(storage, monkeypatch):
    import importlib.util

    from unbroken.errors import MissingDependencyError

    find_spec = importlib.util.find_spec  # Ray is installed here: pretend it is not
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else find_spec(name, *a))
    trainer = DataParallelTrainer(simple_loop, scaling_config=ScalingConfig(engine="ray"),
                                  run_config=RunConfig(name="ray", storage_path=storage))
    with pytest.raises(MissingDependencyError, match=r"pip install 'unbroken\[ray\]'.*engine='local'"):
        trainer.fit()
    assert not os.path.exists(os.path.join(storage, "ray"))


# -- fsspec filesystems that are neither this machine's disk nor an object store -------------------
@pytest.mark.parametrize("kind", ["dirfs", "custom"])
def test_a_run_on_another_kind_of_fsspec_filesystem_checkpoints_and_restores(tmp_path, kind):
    """RunConfig(storage_filesystem=...) with a DirFileSystem (a prefix over this disk, as Ray's
    persistence tests use) or a filesystem with real directories that is neither local nor an
    object store: a run fails over once and finishes from its checkpoint, and restores. Both
    failed at the first checkpoint when every filesystem but LocalFileSystem was taken for an
    object store (no directories created, a DirFileSystem path taken for a key)."""
    from fsspec.implementations.dirfs import DirFileSystem
    from fsspec.implementations.local import LocalFileSystem

    from custom_fs import StrictDirFileSystem

    if kind == "dirfs":
        fs, storage_path = DirFileSystem(path=str(tmp_path), fs=LocalFileSystem()), "runs"
    else:
        fs, storage_path = StrictDirFileSystem(), str(tmp_path / "runs")
    run = RunConfig(name="other-fs", storage_path=storage_path, storage_filesystem=fs,
                    failure_config=FailureConfig(max_failures=1), verbose=0)
    config = {"iterations": 4, "ckpt_every": 2, "fail_at": 3}
    result = DataParallelTrainer(simple_loop, train_loop_config=config,
                                 scaling_config=ScalingConfig(num_workers=2), run_config=run).fit()
    assert [r["training_iteration"] for r in result.rows] == [1, 2, 3, 4]
    attempts = json.load(open(tmp_path / "runs" / "other-fs" / ".unbroken" / "run.json"))["attempts"]
    assert [a["resumed_from"] for a in attempts] == [None, "checkpoint_000002"]
    with result.checkpoint.as_directory() as d:
        assert open(os.path.join(d, "it.txt")).read() == "4"
    again = DataParallelTrainer.restore(result.path, storage_filesystem=result.filesystem,
                                        train_loop_config=dict(config, iterations=5)).fit()
    assert again.metrics["training_iteration"] == 5
