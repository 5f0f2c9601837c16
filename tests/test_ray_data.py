"""Ray Data on the Ray engine: `TorchTrainer(..., datasets={"train": ray.data.Dataset})` and
`train.get_dataset_shard("train").iter_torch_batches(...)`, on a real multi-node Ray cluster on
this machine, read from JSON-lines files the test writes. A rank SIGKILLed mid-epoch resumes
each rank at its next batch, bit for bit; a restore with another number of workers sees each
row once per epoch."""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray")

from conftest import start_script  # noqa: E402
from stream_loops import ray_data_loop, write_shards  # noqa: E402
from test_ray_engine import marker_fifo, read_marker  # noqa: E402
from test_stream_resume import assert_same_run, attempts, kill_step, steps  # noqa: E402
from unbroken.errors import UnsupportedOptionError  # noqa: E402
from unbroken.train import FailureConfig, Result, RunConfig, ScalingConfig  # noqa: E402
from unbroken.train.torch import TorchTrainer  # noqa: E402
from unbroken.worker.ray_data_shard import RayDataShard  # noqa: E402

pytestmark = pytest.mark.ray
MB = 2**20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head with 2 CPUs for Ray Data's tasks and two nodes of 1 CPU for the ranks (a rank needs
    a "rank" slot, which only they have, so that no rank is on the head, which cannot be lost)."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                      "object_store_memory": 80 * MB})
    for name in ("node_a", "node_b"):
        c.add_node(num_cpus=1, object_store_memory=80 * MB, resources={name: 1, "rank": 1})
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_shards(str(tmp_path_factory.mktemp("ray-data")))


def fit(storage, name, files, workers=2, max_failures=0, **config):
    dataset = ray.data.read_json(files)
    return TorchTrainer(ray_data_loop, train_loop_config=config, datasets={"train": dataset},
                        scaling_config=ScalingConfig(num_workers=workers, engine="ray",
                                                     resources_per_worker={"CPU": 1, "rank": 1}),
                        run_config=RunConfig(name=name, storage_path=storage, verbose=0,
                                             failure_config=FailureConfig(max_failures=max_failures))).fit()


def rows_once_an_epoch(result) -> None:
    rows = steps(result)
    for epoch in (0, 1):
        seen = sorted(i for r in rows if r["epoch"] == epoch for rank in r["ids"] for i in rank)
        assert seen == list(range(64)), (epoch, seen)


@pytest.fixture(scope="module")
def reference(cluster, files, tmp_path_factory):
    return fit(str(tmp_path_factory.mktemp("ray-data-ref")), "reference", files)


def test_each_rank_takes_its_share_of_each_global_batch_once_an_epoch(reference):
    rows = steps(reference)
    assert [r["step"] for r in rows] == list(range(1, 17))
    for epoch in (0, 1):
        seen = sorted(i for r in rows if r["epoch"] == epoch for rank in r["ids"] for i in rank)
        assert seen == list(range(64)), epoch
    assert rows[0]["ids"] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the dataset's order, in global batches


def test_a_rank_killed_mid_epoch_resumes_bit_for_bit(cluster, files, storage, reference):
    step = kill_step("ray-data")
    result = fit(storage, "killed", files, max_failures=1, kill_at=[[step, 1, 1, "sigkill"]])
    assert attempts(result)[0]["status"] == "ERRORED"
    assert_same_run(result, reference, f"rank 1 SIGKILLed at step {step}")


def test_a_lost_node_resumes_bit_for_bit(cluster, files, storage, reference, tmp_path):
    # Rank 1 blocks at step 7 (past checkpoint 6) and its node is removed without warning, with
    # whatever Ray Data held there; a node joins in its place and the run goes on from 6.
    marker = str(tmp_path / "hung")
    fifo = marker_fifo(marker)
    driver = start_script(f"""
import ray
from test_ray_data import fit
ray.init(address="auto", log_to_driver=False)
fit({storage!r}, "lost-node", {files!r}, max_failures=1, hang_at=[7, 1], hang_marker={marker!r})
""", RAY_ADDRESS=cluster.address)
    node_id = read_marker(fifo, driver, "rank 1 to block at step 7")
    node = next(n for n in cluster.list_all_nodes() if n.node_id == node_id)
    cluster.remove_node(node, allow_graceful=False)
    cluster.add_node(num_cpus=1, object_store_memory=80 * MB, resources={"rank": 1})
    out, err = driver.communicate(timeout=180)
    assert driver.returncode == 0, err[-3000:]
    result = Result.from_path(os.path.join(storage, "lost-node"))
    first, second = attempts(result)
    assert "lost with its node" in first["error"] and second["resumed_from"] == "checkpoint_000006", first
    assert_same_run(result, reference, "rank 1's node removed at step 7")


def test_another_number_of_workers_sees_each_row_once_an_epoch(cluster, files, storage):
    # Killed at step 5 (checkpoint 3: 24 rows of epoch 0 consumed), restored on one worker.
    from unbroken.train import TrainingFailedError

    with pytest.raises(TrainingFailedError):
        fit(storage, "resized", files, kill_at=[[5, 1, 0, "raise"]])
    path = os.path.join(storage, "resized")
    one = ScalingConfig(num_workers=1, engine="ray", resources_per_worker={"CPU": 1, "rank": 1})
    result = TorchTrainer.restore(path, datasets={"train": ray.data.read_json(files)},
                                  scaling_config=one).fit()
    rows_once_an_epoch(result)


def test_a_driver_killed_and_restored_resumes_bit_for_bit(cluster, files, storage, reference, tmp_path):
    step = kill_step("ray-data-driver")
    marker = str(tmp_path / "reported")
    fifo = marker_fifo(marker)
    driver = start_script(f"""
import ray
from test_ray_data import fit
ray.init(address="auto", log_to_driver=False)
fit({storage!r}, "driver-killed", {files!r}, signal_at=[{step}, 1], signal_marker={marker!r})
""", RAY_ADDRESS=cluster.address)
    read_marker(fifo, driver, f"step {step} to be reported")
    driver.kill()
    driver.wait()
    path = os.path.join(storage, "driver-killed")
    result = TorchTrainer.restore(path, datasets={"train": ray.data.read_json(files)}).fit()
    assert attempts(result)[-1]["status"] == "FINISHED"
    assert_same_run(result, reference, f"driver SIGKILLed after step {step}")


def test_an_elastic_run_that_loses_a_node_shrinks_and_sees_each_row_once_an_epoch(cluster, files, storage,
                                                                                    tmp_path):
    # num_workers=(1, 2): rank 1 blocks at step 7 and its node is removed for good; the run goes
    # on with one rank from checkpoint 6, which cuts the rest of the pass into its own batches.
    marker = str(tmp_path / "hung")
    fifo = marker_fifo(marker)
    driver = start_script(f"""
import ray
from stream_loops import ray_data_loop
from unbroken.train import FailureConfig, RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer
ray.init(address="auto", log_to_driver=False)
TorchTrainer(ray_data_loop, train_loop_config={{"hang_at": [7, 1], "hang_marker": {marker!r}}},
             datasets={{"train": ray.data.read_json({files!r})}},
             scaling_config=ScalingConfig(num_workers=(1, 2), engine="ray",
                                          resources_per_worker={{"CPU": 1, "rank": 1}}),
             run_config=RunConfig(name="elastic", storage_path={storage!r}, verbose=0,
                                  failure_config=FailureConfig(max_failures=1))).fit()
""", RAY_ADDRESS=cluster.address)
    try:
        node_id = read_marker(fifo, driver, "rank 1 to block at step 7")
        cluster.remove_node(next(n for n in cluster.list_all_nodes() if n.node_id == node_id),
                            allow_graceful=False)
        out, err = driver.communicate(timeout=240)
    finally:
        if driver.poll() is None:
            driver.kill()
        cluster.add_node(num_cpus=1, object_store_memory=80 * MB, resources={"rank": 1})
    assert driver.returncode == 0, err[-3000:]
    result = Result.from_path(os.path.join(storage, "elastic"))
    assert [a["num_workers"] for a in attempts(result)] == [2, 1], attempts(result)
    rows_once_an_epoch(result)


def test_a_local_shuffle_buffer_is_refused_with_a_hint():
    shard = RayDataShard(None, 0, 1)
    with pytest.raises(UnsupportedOptionError, match="random_shuffle"):
        next(shard.iter_torch_batches(batch_size=4, local_shuffle_buffer_size=64))


def test_the_shard_iterates_as_rays_iterator_and_reshares_the_rest_of_a_pass(cluster):
    # Both ranks' shares of each format, in the driver; then a position taken half way through
    # a pass on 2 ranks continues on 1 with the rows not yet consumed, each once.
    dataset = ray.data.range(22)
    shards = [RayDataShard(dataset, rank, 2) for rank in range(2)]
    numpy_ids = [[b["id"].tolist() for b in s.iter_batches(batch_size=3)] for s in shards]
    assert numpy_ids == [[[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19]],
                         [[3, 4, 5], [9, 10, 11], [15, 16, 17], [20, 21]]]
    frames = [list(s.iter_batches(batch_size=3, batch_format="pandas")) for s in shards]
    assert [f["id"].tolist() for f in frames[1]] == numpy_ids[1]
    assert [r["id"] for r in shards[0].iter_rows()] == list(range(0, 22, 2))
    first, second = (s.iter_batches(batch_size=3, drop_last=True) for s in shards)
    taken = [next(first)["id"].tolist(), next(second)["id"].tolist(),
             next(first)["id"].tolist(), next(second)["id"].tolist()]
    alone = RayDataShard(dataset, 0, 1)
    alone.load_state_dict(shards[0].state_dict())
    rest = [i for b in alone.iter_batches(batch_size=3) for i in b["id"].tolist()]
    assert sorted(i for b in taken for i in b) + rest == list(range(22))
