"""The Ray engine on a real multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`:
a head with no CPUs and two nodes with one CPU each), killing ranks, removing nodes and
killing the driver. These tests run last (see conftest): they attach the test process to Ray,
whose threads make later local-engine tests start their workers from a forkserver."""

from __future__ import annotations

import contextlib
import io
import json
import os
import select
import signal
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from conftest import read_until, s3_env, start_script, sweep_json  # noqa: E402
from loops import final_weights, steps_run  # noqa: E402
from ray_loops import placed_loop  # noqa: E402
from test_exact_resume import BASE, assert_same_run, exact_loop  # noqa: E402
from unbroken.cli import commands as cli  # noqa: E402
from unbroken.errors import InsufficientResourcesError, StorageNotSharedError  # noqa: E402
from unbroken.execution.engine.factory import make_worker_group, resolve_engine  # noqa: E402
from unbroken.train import (  # noqa: E402
    CheckpointConfig,
    FailureConfig,
    Result,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
)
from unbroken.train.torch import TorchTrainer  # noqa: E402

pytestmark = pytest.mark.ray

MB = 2**20
NODE = {"num_cpus": 1, "object_store_memory": 80 * MB}
OTHER_ROOT = "UNBROKEN_TEST_OTHER_ROOT"  # set on node_b only: NodeLocalFS sees another tree there
# A removed node is declared dead after 3 missed health checks a second apart (Ray's default:
# 5, 3 s apart), so that what waits for Ray's verdict (a lost trial driver's relaunch) waits
# less; nothing here depends on how long the verdict takes.
FAST_VERDICT = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


def _add_node(cluster, name: str, env: dict[str, str] | None = None):
    return cluster.add_node(**NODE, resources={name: 1}, env_vars=env or {})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, s3_endpoint):
    """Every node has the object store's credentials in its environment, as a cloud node would."""
    from ray.cluster_utils import Cluster

    other = str(tmp_path_factory.mktemp("other-root"))
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                      "object_store_memory": 80 * MB,
                                                      "_system_config": FAST_VERDICT})
    c.node_env = s3_env(s3_endpoint)
    _add_node(c, "node_a", c.node_env)
    _add_node(c, "node_b", {**c.node_env, OTHER_ROOT: other})
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    c.other_root = other
    yield c
    ray.shutdown()
    c.shutdown()


def trainer(storage: str, name: str, directory: str, max_failures: int = 0, hang_timeout_s: float = 120,
            **config) -> TorchTrainer:
    failures = FailureConfig(max_failures=max_failures, hang_timeout_s=hang_timeout_s)
    return TorchTrainer(placed_loop, train_loop_config={"iterations": 8, "dir": directory, **config},
                        scaling_config=ScalingConfig(num_workers=2, engine="ray"),
                        run_config=RunConfig(name=name, storage_path=storage, verbose=0,
                                             failure_config=failures))


def placements_of(directory: str, attempt: int, ranks: int = 1) -> list[dict]:
    return [json.load(open(os.path.join(directory, f"rank{r}-a{attempt}.json"))) for r in range(ranks)]


def placements(directory: str, attempt: int) -> list[dict]:
    return placements_of(directory, attempt, 2)


def iterations(result) -> list[int]:
    return result.metrics_dataframe["training_iteration"].tolist()


def attempts_at(path: str) -> list[dict]:
    return json.load(open(os.path.join(path, ".unbroken", "run.json")))["attempts"]


def attempts(result) -> list[dict]:
    return attempts_at(result.path)


def printed_rows(out: str) -> list[int]:
    """The iterations a driver script printed after "ROWS" (Ray's log lines may follow)."""
    return json.loads(out.split("ROWS", 1)[1].splitlines()[0])


def wait_ended(pids: list[int], what: str, timeout: float) -> None:
    """Wait until every process in `pids` (not this process's children) has exited: on pidfds,
    which the kernel makes readable when the process ends."""
    fds = []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))
        except ProcessLookupError:
            pass  # gone already
    deadline = time.monotonic() + timeout
    try:
        pending = list(fds)
        while pending:
            ready, _, _ = select.select(pending, [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(f"timed out waiting for {what}")
            pending = [fd for fd in pending if fd not in ready]
    finally:
        for fd in fds:
            os.close(fd)


def marker_fifo(path: str) -> int:
    """A FIFO at `path` for a loop's `hang_marker`, opened for reading (before the driver starts,
    so that the rank's open for writing does not block); `read_marker` waits on it."""
    os.mkfifo(path)
    return os.open(path, os.O_RDONLY | os.O_NONBLOCK)


def read_marker(fd: int, driver, what: str, timeout: float = 120.0) -> str:
    """What the rank wrote into the marker FIFO, once it closed it (the kernel wakes us: data,
    then end of file); fails if the driver ends first."""
    ended = os.pidfd_open(driver.pid)
    data, deadline = b"", time.monotonic() + timeout
    try:
        while True:
            ready, _, _ = select.select([fd, ended], [], [], max(0.0, deadline - time.monotonic()))
            if fd in ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    return data.decode()
                data += chunk
            elif ready:
                raise AssertionError(f"the driver ended before {what}: {driver.communicate()[1][-2000:]}")
            else:
                raise AssertionError(f"timed out waiting for {what}")
    finally:
        os.close(ended)
        os.close(fd)


def replace_node(cluster, node_id: str) -> None:
    """Remove the node `node_id` without warning (its processes die with it) and add one in its
    place, with the same custom resource and storage view."""
    node = next(n for n in cluster.list_all_nodes() if n.node_id == node_id)
    resources = next(n["Resources"] for n in ray.nodes() if n["NodeID"] == node_id)
    name = "node_b" if "node_b" in resources else "node_a"
    cluster.remove_node(node, allow_graceful=False)
    other = {OTHER_ROOT: cluster.other_root} if name == "node_b" else {}
    _add_node(cluster, name, {**cluster.node_env, **other})


# -- the connection to the driver ----------------------------------------------------------
def test_the_driver_takes_only_connections_that_prove_the_attempts_secret(monkeypatch):
    import socket
    import threading
    from multiprocessing.connection import AuthenticationError, Client

    from unbroken.execution.engine.ray_link import Listener as _Listener

    monkeypatch.setattr("unbroken.execution.engine.ray_link.HANDSHAKE_S", 1)
    listener = _Listener("127.0.0.1", b"s" * 32)
    outcome: dict = {}

    def dial(key: bytes) -> None:
        try:
            Client(listener.address, authkey=key).send(("hello", 0))
            outcome[key] = "connected"
        except (AuthenticationError, EOFError, ConnectionError) as e:
            outcome[key] = type(e).__name__

    try:
        for key, taken in ((b"x" * 32, False), (b"s" * 32, True)):
            caller = threading.Thread(target=dial, args=(key,))
            caller.start()
            conn = listener.accept()
            caller.join()
            assert (conn is not None) is taken, (key, outcome)
        assert conn.recv() == ("hello", 0) and outcome[b"x" * 32] == "AuthenticationError"
        with socket.create_connection(listener.address):  # a stranger that never answers
            assert listener.accept() is None
    finally:
        listener.close()


# -- placement -----------------------------------------------------------------------------
def test_auto_picks_ray_once_the_driver_joined_a_cluster(cluster):
    assert resolve_engine(ScalingConfig(engine="auto")) == "ray"
    assert resolve_engine(ScalingConfig(engine="local")) == "local"


def test_ranks_are_actors_on_distinct_nodes_ordered_by_node(cluster, storage, tmp_path):
    result = TorchTrainer(
        placed_loop, train_loop_config={"iterations": 4, "dir": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=2, engine="auto", placement_strategy="STRICT_SPREAD"),
        run_config=RunConfig(name="spread", storage_path=storage, verbose=0)).fit()
    ranks = placements(str(tmp_path), 1)
    assert len({r["node_id"] for r in ranks}) == 2
    assert [(r["node_rank"], r["local_rank"], r["local_world_size"]) for r in ranks] == [(0, 0, 1), (1, 0, 1)]
    assert iterations(result) == [1, 2, 3, 4]
    wait_ended([r["pid"] for r in ranks], "the actors to be killed", 20)


def test_a_cluster_without_room_fails_with_the_missing_resources(cluster, storage, monkeypatch):
    monkeypatch.setattr("unbroken.execution.engine.ray.PLACEMENT_TIMEOUT_S", 1.0)
    group = make_worker_group(ScalingConfig(num_workers=3, engine="ray", placement_strategy="STRICT_SPREAD"))
    t0 = time.monotonic()
    try:
        with pytest.raises(InsufficientResourcesError,
                           match=r"could not place 3 workers.*CPU: 3 needed, 2 in the cluster.*Hint"):
            group.start(lambda p: None)
    finally:
        group.shutdown(kill=True)
    assert time.monotonic() - t0 < 10
    # The placement group is gone: the cluster's CPUs are free again, one on each node.
    from ray.util.placement_group import placement_group, remove_placement_group

    both = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_SPREAD")
    try:
        assert both.wait(10), "the CPUs were not released"
    finally:
        remove_placement_group(both)


def test_an_elastic_run_below_min_workers_waits_then_fails_naming_what_is_missing(
        cluster, storage, monkeypatch):
    monkeypatch.setattr("unbroken.execution.engine.ray_capacity.PLACEMENT_TIMEOUT_S", 2.0)
    trainer = TorchTrainer(placed_loop, train_loop_config={"iterations": 2, "dir": storage},
                           scaling_config=ScalingConfig(num_workers=(3, 4), engine="ray"),
                           run_config=RunConfig(name="too-few", storage_path=storage, verbose=0))
    t0 = time.monotonic()
    missing = (r"needs at least 3 workers, and only 2 could be placed within 2 s "
               r"\(each worker needs \{'CPU': 1.0\}\)")
    with pytest.raises(TrainingFailedError, match=missing + r".*Hint: add nodes"):
        trainer.fit()
    assert 2.0 <= time.monotonic() - t0 < 15, "it waited for capacity, bounded"
    run = json.load(open(os.path.join(storage, "too-few", ".unbroken", "run.json")))
    assert run["status"] == "ERRORED" and run["attempts"] == [], "no attempt started, nothing placed"


def test_a_node_that_sees_other_storage_fails_before_training(cluster, tmp_path):
    from fsspec.implementations.dirfs import DirFileSystem

    class NodeLocalFS(DirFileSystem):
        """A directory that resolves, on each node, under that node's own root when it has one
        (a local disk path on a cluster: each node sees its own)."""

        def __reduce__(self):
            return (_node_local_fs, (self.path,))

    root = str(tmp_path / "shared")
    os.makedirs(root)
    with pytest.raises(TrainingFailedError) as info:
        TorchTrainer(placed_loop, train_loop_config={"iterations": 2, "dir": str(tmp_path)},
                     scaling_config=ScalingConfig(num_workers=2, engine="ray",
                                                  placement_strategy="STRICT_SPREAD"),
                     run_config=RunConfig(name="unshared", storage_path="runs", verbose=0,
                                          storage_filesystem=NodeLocalFS(path=root),
                                          failure_config=FailureConfig(max_failures=3))).fit()
    error = info.value.__cause__
    assert isinstance(error, StorageNotSharedError), error
    assert "does not see the run directory" in str(error) and "Hint" in str(error)
    node_b = [n for n in ray.nodes() if n["Resources"].get("node_b")][0]["NodeManagerAddress"]
    assert f"on node {node_b}" in str(error)
    assert not os.path.exists(tmp_path / "rank0-a2.json"), "a storage error must not be retried"

    # A sweep's trial driver placed on node_b does not see the sweep: the trial errs at once.
    from unbroken import tune

    pinned = ScalingConfig(num_workers=1, engine="ray", trainer_resources={"node_b": 0.01})
    grid = tune.Tuner(TorchTrainer(placed_loop, train_loop_config={"iterations": 2, "dir": str(tmp_path)},
                                   scaling_config=pinned),
                      run_config=RunConfig(name="unshared-sweep", storage_path="runs", verbose=0,
                                           storage_filesystem=NodeLocalFS(path=root))).fit()
    (trial,) = grid.errors
    assert "StorageNotSharedError" in str(trial) and "does not see the sweep" in str(trial), trial


def _node_local_fs(path: str):
    from fsspec.implementations.dirfs import DirFileSystem

    other = os.environ.get(OTHER_ROOT)
    return DirFileSystem(path=os.path.join(other, "elsewhere") if other else path)


@pytest.mark.slow  # S3 runs and killed ranks on Ray are each in the default run; together, a soak
def test_a_run_on_object_storage_shared_by_every_node_survives_a_killed_rank(cluster, tmp_path, monkeypatch):
    for key, value in cluster.node_env.items():
        monkeypatch.setenv(key, value)
    result = trainer("s3://bucket/ray-runs", "on-s3", str(tmp_path), max_failures=1, iterations=4,
                     kill_worker_at=[3, 1]).fit()
    assert result.url.startswith("s3://bucket/ray-runs/on-s3") and result.path == result.url[len("s3://"):]
    assert iterations(result) == [1, 2, 3, 4]
    assert result.checkpoint.path.endswith("checkpoint_000004") and final_weights(result)


# -- failures ------------------------------------------------------------------------------
def test_a_killed_a_raising_and_a_stuck_rank_each_restart_the_group_from_the_checkpoint(
        cluster, storage, tmp_path, monkeypatch):
    # warm up at the first round
    monkeypatch.setattr("unbroken.execution.recovery.after_failure.WARM_UP_AFTER_S", 0.0)
    result = trainer(storage, "failing-ranks", str(tmp_path), max_failures=3, hang_timeout_s=6,
                     kill_worker_at=[5, 1], fail_at=[6, 2], hang_at=[7, 3]).fit()
    assert iterations(result) == list(range(1, 9))
    killed, raised, stuck, finished = attempts(result)
    assert "died" in killed["error"] and "ActorDiedError" in killed["error"], killed["error"]
    assert "injected failure at iteration 6" in raised["error"], raised["error"]
    assert "WorkerHangError" in stuck["error"], stuck["error"]
    # Its stacks, dumped by a task on each rank's node before the group was torn down.
    assert stuck["hang"]["waited_for"] == [1] and "loops.py:" in (stuck["hang"]["where"]["1"] or ""), stuck
    resumed = [a["resumed_from"] for a in (raised, stuck, finished)]
    assert resumed == ["checkpoint_000004", "checkpoint_000004", "checkpoint_000006"]
    assert finished["status"] == "FINISHED"
    # The first attempt's actors started cold; each restart ran on the spares that the failed
    # attempt had warmed up (torch._dynamo imported before the loop's DDP), new processes all.
    assert [[r["warm"] for r in placements(str(tmp_path), a)] for a in (1, 2, 3, 4)] == \
        [[False, False]] + [[True, True]] * 3
    assert len({r["pid"] for a in (1, 2, 3, 4) for r in placements(str(tmp_path), a)}) == 8


@pytest.mark.slow  # 21 s; node removals are in the elastic and just-in-time tests
def test_a_removed_node_is_a_lost_rank_and_the_run_finishes_on_a_replacement(cluster, storage, tmp_path):
    marker = str(tmp_path / "hung")
    fifo = marker_fifo(marker)
    driver = start_script(f"""
from test_ray_engine import trainer
result = trainer({storage!r}, "lost-node", {str(tmp_path)!r}, max_failures=1, ckpt_every=1,
                 hang_at=[3, 1], hang_marker={marker!r}).fit()
print("ROWS", result.metrics_dataframe["training_iteration"].tolist())
""", RAY_ADDRESS=cluster.address)
    read_marker(fifo, driver, "rank 1 to block")
    node_id = placements(str(tmp_path), 1)[1]["node_id"]
    replace_node(cluster, node_id)
    out, err = driver.communicate(timeout=180)
    assert driver.returncode == 0, err
    assert printed_rows(out) == list(range(1, 9))
    first, second = attempts_at(os.path.join(storage, "lost-node"))
    assert first["status"] == "ERRORED" and "lost with its node" in first["error"], first["error"]
    assert second["resumed_from"] == "checkpoint_000002"
    assert node_id not in {r["node_id"] for r in placements(str(tmp_path), 2)}


def node_named(name: str) -> str | None:
    return next((n["NodeID"] for n in ray.nodes() if n.get("Alive") and name in n["Resources"]), None)


def remove_for_good(cluster, node_id: str) -> str:
    """Remove node `node_id` without warning, and no node in its place; returns its name."""
    name = next(k for k in ("node_a", "node_b", "node_c") if node_named(k) == node_id)
    cluster.remove_node(next(n for n in cluster.list_all_nodes() if n.node_id == node_id),
                        allow_graceful=False)
    return name


def add_back(cluster, name: str) -> None:
    """A node named `name` joins, with that name's storage view."""
    _add_node(cluster, name, {**cluster.node_env, **({OTHER_ROOT: cluster.other_root} if name == "node_b"
                                                     else {})})


def end_on_two_nodes(cluster, driver) -> None:
    """After an elastic test: its driver ended, and the cluster back to node_a and node_b."""
    if driver.poll() is None:
        driver.kill()
    extra = node_named("node_c")
    if extra is not None:
        cluster.remove_node(next(n for n in cluster.list_all_nodes() if n.node_id == extra),
                            allow_graceful=False)


# 31 s; the default run shrinks and grows on Ray in place (below), the restart path's sizing
# with a fake group (test_elastic), and the harness's --elastic soak kills drivers mid-resize.
@pytest.mark.slow
def test_an_elastic_run_shrinks_at_once_on_a_lost_node_and_grows_back_when_one_returns(
        cluster, storage, tmp_path):
    """num_workers=(2, 3) on three 1-CPU nodes: a node is removed mid-run and no node replaces it,
    so the run goes on with 2 workers at once, on the spares kept warm; a node is added later and
    the run stops to grow to 3 within the monitor interval and a report. The driver is SIGKILLed
    right then, between the two attempts of the resize, and a restore goes on on 3 workers
    from the checkpoint the resize took. Each iteration once, every row's world size."""
    _add_node(cluster, "node_c", cluster.node_env)
    cluster.wait_for_nodes()
    lost_marker, running_marker = str(tmp_path / "lost"), str(tmp_path / "shrunk")
    lost_fifo, running_fifo = marker_fifo(lost_marker), marker_fifo(running_marker)
    driver = start_script(f"""
from ray_loops import placed_loop
from unbroken.train import FailureConfig, RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer
result = TorchTrainer(placed_loop, train_loop_config={{
        "iterations": 60, "dir": {str(tmp_path)!r}, "ckpt_every": 2, "on_request": True, "step_s": 0.1,
        "hang_at": [5, 1], "hang_marker": {lost_marker!r},
        "signal_at": [9, 2], "signal_marker": {running_marker!r}}},
    scaling_config=ScalingConfig(num_workers=(2, 3), engine="ray", elastic_resize_monitor_interval_s=2),
    run_config=RunConfig(name="elastic", storage_path={storage!r}, verbose=0,
                         failure_config=FailureConfig(max_failures=1, hang_timeout_s=120))).fit()
print("ROWS", result.metrics_dataframe["training_iteration"].tolist())
""", RAY_ADDRESS=cluster.address, UNBROKEN_WARM_UP_AFTER_S="0", UNBROKEN_FAULT="after_resize_stop:1")
    path = os.path.join(storage, "elastic")
    try:
        read_marker(lost_fifo, driver, "rank 2 to block at iteration 5")
        lost = placements_of(str(tmp_path), 1, 3)[2]["node_id"]
        name = remove_for_good(cluster, lost)
        read_marker(running_fifo, driver, "attempt 2 to reach iteration 9")
        added_at = time.time()
        add_back(cluster, name)
        _, err = driver.communicate(timeout=240)
        assert driver.returncode == -signal.SIGKILL, err
        restored = start_script(f"""
from unbroken.train.torch import TorchTrainer
print("ROWS", TorchTrainer.restore({path!r}).fit().metrics_dataframe["training_iteration"].tolist())
""", RAY_ADDRESS=cluster.address)
        out, err = restored.communicate(timeout=240)
    finally:
        end_on_two_nodes(cluster, driver)
    assert restored.returncode == 0, err
    assert printed_rows(out) == list(range(1, 61)), "each iteration once"
    first, second, third = attempts_at(path)
    assert (first["status"], first["num_workers"], first["elastic"]["reason"]) == ("ERRORED", 3, "start")
    assert "lost with its node" in first["error"]
    assert (second["status"], second["num_workers"], second["elastic"]["reason"]) == (
        "RESIZED", 2, "node lost")
    assert second["started_at"] < added_at, "it shrank without waiting for a node"
    shrunk = placements_of(str(tmp_path), 2, 2)
    assert lost not in {p["node_id"] for p in shrunk}
    assert all(p["warm"] for p in shrunk), "the 2 ranks started on the spares kept warm on the live nodes"
    assert second["ended_at"] - added_at < 2 + 30, "it stopped to grow within the interval and a report"
    assert (third["status"], third["num_workers"], third["elastic"]["reason"]) == ("FINISHED", 3, "start")
    assert third["resumed_iteration"] >= 9, "the restore resumed from the checkpoint the resize took"
    rows = Result.from_path(path).metrics_dataframe
    sizes = dict(zip(rows["training_iteration"], rows["world_size"], strict=True))
    assert {sizes[i] for i in range(second["resumed_iteration"] + 1, third["resumed_iteration"] + 1)} == {2}
    assert {sizes[i] for i in range(third["resumed_iteration"] + 1, 61)} == {3}


@pytest.mark.slow  # 30 s; preemption is covered locally (test_preemption), kills on Ray by the harness
def test_preempted_then_killed_driver_leaves_no_actor_and_restore_from_another_process_finishes(
        cluster, storage, tmp_path):
    env = {"RAY_ADDRESS": cluster.address}
    path = os.path.join(storage, "driver-kill")
    restore = f"""
from unbroken.train.torch import TorchTrainer
result = TorchTrainer.restore({path!r}).fit()
print("ROWS", result.metrics_dataframe["training_iteration"].tolist())
"""
    # 1. A preemption notice: the ranks checkpoint at their next report, and the driver stops.
    first = start_script(f"""
from test_ray_engine import trainer
trainer({storage!r}, "driver-kill", {str(tmp_path)!r}, echo=True, on_request=True, iterations=40).fit()
""", **env)
    read_until(first, "REPORTED 3")
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=60)
    assert "TrainingInterruptedError" in err and "latest committed checkpoint is checkpoint_" in err, err
    interrupted = attempts_at(path)[-1]
    assert interrupted["status"] == "PREEMPTED" and interrupted["preempted"]["source"] == "SIGTERM"
    # 2. Restored in another process, then SIGKILLed: Ray kills its actors with it.
    second = start_script(restore, **env)
    read_until(second, "REPORTED")
    pids = [r["pid"] for r in placements(str(tmp_path), 2)]
    os.kill(second.pid, signal.SIGKILL)
    second.wait()
    wait_ended(pids, "the killed driver's actors to die", 20)
    # 3. Restored again: the run finishes with every iteration once.
    third = start_script(restore, **env)
    out, err = third.communicate(timeout=180)
    assert third.returncode == 0, err
    assert printed_rows(out) == list(range(1, 41))
    assert [a["status"] for a in attempts_at(path)] == ["PREEMPTED", "ABORTED", "FINISHED"]


@pytest.mark.slow  # 14 s; the in-place test below compares a Ray run with a local one bit for bit
def test_exact_resume_on_ray_equals_the_local_engine_bit_for_bit(cluster, storage):
    config = {**BASE, "kill_at": [[7, 1, 1, "sigkill"]]}

    def run(engine: str, name: str, **extra):
        return TorchTrainer(exact_loop, train_loop_config={**config, **extra},
                            scaling_config=ScalingConfig(num_workers=2, engine=engine),
                            run_config=RunConfig(name=name, storage_path=storage, verbose=0,
                                                 failure_config=FailureConfig(max_failures=1))).fit()

    local = run("local", "local", kill_at=[])
    on_ray = run("ray", "ray")
    assert [a["status"] for a in attempts(on_ray)] == ["ERRORED", "FINISHED"]
    assert_same_run(on_ray, local, "Ray engine with a killed rank vs the local engine uninterrupted")


def jit_run(engine: str, storage: str, name: str, in_place: bool = False, hang_timeout_s=None, **config):
    failures = FailureConfig(max_failures=1, recovery="in_place" if in_place else "checkpoint",
                             hang_timeout_s=hang_timeout_s)
    return TorchTrainer(exact_loop, train_loop_config={**BASE, "jit": True, **config},
                        scaling_config=ScalingConfig(num_workers=2, engine=engine),
                        run_config=RunConfig(name=name, storage_path=storage, verbose=0,
                                             failure_config=failures)).fit()


@pytest.mark.slow  # 10 s; just-in-time saves are engine-neutral (test_jit_checkpoint), offers on Ray below
def test_a_killed_rank_on_ray_resumes_from_the_survivors_checkpoint_bit_for_bit(cluster, storage):
    local = jit_run("local", storage, "jit-local")
    on_ray = jit_run("ray", storage, "jit-ray", die_after_report=[[6, 1, 1, "sigkill"]])
    first, second = attempts(on_ray)
    assert (first["jit_checkpoint"]["iteration"], first["jit_checkpoint"]["rank"]) == (6, 0), first
    assert second["resumed_from"] == "checkpoint_000006"
    assert_same_run(on_ray, local, "Ray engine, rank 1 killed after report 6, vs the local engine")


@pytest.mark.parametrize("how", ["sigkill", "sigkill-in-loop",
                                 pytest.param("sigstop", marks=pytest.mark.slow),
                                 pytest.param("raise-untracked", marks=pytest.mark.slow)])
def test_a_killed_rank_on_ray_is_replaced_in_place_while_the_survivor_keeps_its_actor(
        cluster, storage, tmp_path, monkeypatch, how):
    # Rank 1's actor is SIGKILLed after report 6 (or stopped, then found at the hang timeout and
    # killed alone), once the group kept spares warm: rank 0's actor stays, rank 1 starts again
    # on its spare, rank 0 sends it the state of round 6 over the new process group, and the run
    # ends as the uninterrupted one on the local engine. "raise-untracked": rank 1 raises right
    # after sending report 6, before its state took it in, so it cannot help; its actor outlives
    # its attempt and keeps rank 0 blocked, until the driver kills it and rank 0 offers round 6.
    # "sigkill-in-loop": rank 1 is killed after report 5, mid-epoch, and rank 0's actor stays
    # inside its loop (TrainState.for_each_batch), with the model it built.
    in_loop = how == "sigkill-in-loop"
    step = 5 if in_loop else 6
    local = jit_run("local", storage, f"in-place-local-{how}")
    monkeypatch.setattr("unbroken.execution.recovery.after_failure.WARM_UP_AFTER_S", 0.0)
    dies = [[step, 1, 1, how.removesuffix("-in-loop")]]
    if how == "raise-untracked":
        monkeypatch.setenv("UNBROKEN_FAULT", "after_report:6:raise:1:once")
        monkeypatch.setenv("UNBROKEN_FAULT_LOG", str(tmp_path / "faults"))
        dies = []
    on_ray = jit_run("ray", storage, f"in-place-ray-{how}", in_place=True, pid_dir=str(tmp_path),
                     die_after_report=dies, hang_timeout_s=5 if how == "sigstop" else None, in_loop=in_loop)
    first, second = attempts(on_ray)
    if how == "sigstop":
        assert first["hang"]["killed"] == [1], first
    assert second["in_place"] == {"iteration": step, "source": 0, "kept": [0], "replaced": [1]}, second
    assert second["resumed_from"] is None and first.get("jit_checkpoint") is None
    pid = {(r, a): open(os.path.join(tmp_path, f"rank{r}-a{a}")).read()
           for r in (0, 1) for a in (1, 2) if os.path.exists(os.path.join(tmp_path, f"rank{r}-a{a}"))}
    assert pid[(1, 1)] != pid[(1, 2)]
    if in_loop:
        assert (0, 2) not in pid, "rank 0 did not run its training function again"
        assert len({row[2:] for row in steps_run(tmp_path, 0)}) == 1, "same actor, model and optimizer"
    else:
        assert pid[(0, 1)] == pid[(0, 2)]
    assert_same_run(on_ray, local, "Ray engine, rank 1 killed after report 6, recovered in place")


@pytest.mark.slow  # the default run keeps the node-removal test above and the killed-rank one
def test_a_removed_node_resumes_from_the_survivors_checkpoint_bit_for_bit(cluster, storage, tmp_path):
    # Rank 1 hangs after report 6 and its node is removed: its processes die with the node
    # (on this one machine their connections reset), rank 0's collective fails, and rank 0
    # saves checkpoint 6 (where a lost node leaves rank 0 blocked instead, the driver falls
    # back after OFFER_WAIT_S: test_jit_checkpoint's hung survivor).
    marker = str(tmp_path / "hung")
    fifo = marker_fifo(marker)
    driver = start_script(f"""
from test_ray_engine import jit_run
jit_run("ray", {storage!r}, "jit-lost-node", die_after_report=[[6, 1, 1, "hang"]], hang_marker={marker!r})
""", RAY_ADDRESS=cluster.address)
    replace_node(cluster, read_marker(fifo, driver, "rank 1 to block"))  # the rank wrote its node
    _, err = driver.communicate(timeout=180)
    assert driver.returncode == 0, err
    on_ray = Result.from_path(os.path.join(storage, "jit-lost-node"))
    first, second = attempts(on_ray)
    assert first["jit_checkpoint"]["iteration"] == 6, first
    assert second["resumed_from"] == "checkpoint_000006"
    assert_same_run(on_ray, jit_run("local", storage, "jit-local-2"), "Ray engine, rank 1's node removed")


@pytest.mark.slow  # 30 s; in place on Ray above, a lost node's checkpoint just in time in the test before
def test_a_removed_nodes_rank_is_replaced_in_place_on_another_node_bit_for_bit(cluster, storage, tmp_path):
    # As above, with recovery="in_place": rank 0 keeps its actor and sends the state of round
    # 6 to rank 1, started again in its bundle, which Ray places on the node added in place of
    # the lost one; nothing is saved to storage for it.
    marker = str(tmp_path / "hung")
    fifo = marker_fifo(marker)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    driver = start_script(f"""
from test_ray_engine import jit_run
jit_run("ray", {storage!r}, "in-place-lost-node", in_place=True, pid_dir={str(pid_dir)!r},
        die_after_report=[[6, 1, 1, "hang"]], hang_marker={marker!r})
""", RAY_ADDRESS=cluster.address)
    lost = read_marker(fifo, driver, "rank 1 to block")
    replace_node(cluster, lost)
    _, err = driver.communicate(timeout=240)
    assert driver.returncode == 0, err
    on_ray = Result.from_path(os.path.join(storage, "in-place-lost-node"))
    first, second = attempts(on_ray)
    assert "rank 1 (of the ray engine) was lost with its node" in first["error"], first["error"]
    assert second["in_place"] == {"iteration": 6, "source": 0, "kept": [0], "replaced": [1]}, second
    assert second["resumed_from"] is None and first.get("jit_checkpoint") is None
    pid = {(r, a): (pid_dir / f"rank{r}-a{a}").read_text() for r in (0, 1) for a in (1, 2)}
    assert pid[(0, 1)] == pid[(0, 2)], "rank 0 kept its actor's process"
    assert_same_run(on_ray, jit_run("local", storage, "in-place-local-lost"),
                    "Ray engine, rank 1's node removed, recovered in place")


def test_an_elastic_run_shrinks_in_place_on_a_lost_node_then_grows_when_one_returns(
        cluster, storage, tmp_path):
    """num_workers=(2, 3), recovery="in_place": rank 2 blocks after report 6 and its node is removed
    with no node in its place. Ranks 0 and 1 go on as a run of 2 from round 6, with the state a
    survivor holds, in the processes they had, without waiting for capacity and without
    reading storage. Their loop is `for_each_batch`, which cannot go on with another world
    size: the ranks offer from inside it, and run the training function again (`RejoinAnew`).
    A node is then added; Ray places the lost rank's bundle there, and the run grows back to 3
    at a checkpoint. Each iteration once, and each sample once per epoch across both sizes."""
    _add_node(cluster, "node_c", cluster.node_env)
    cluster.wait_for_nodes()
    epochs = 4  # steps enough after the shrink for a node to join and the run to grow
    marker, pid_dir = str(tmp_path / "hung"), tmp_path / "pids"
    fifo = marker_fifo(marker)
    pid_dir.mkdir()
    driver = start_script(f"""
from test_exact_resume import BASE, exact_loop
from unbroken.train import FailureConfig, RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer
TorchTrainer(exact_loop, train_loop_config={{**BASE, "epochs": {epochs}, "jit": True, "step_s": 0.4,
        "in_loop": True, "pid_dir": {str(pid_dir)!r}, "echo": True, "die_after_report": [[6, 1, 2, "hang"]],
        "hang_marker": {marker!r}}},
    scaling_config=ScalingConfig(num_workers=(2, 3), engine="ray", elastic_resize_monitor_interval_s=1),
    run_config=RunConfig(name="shrink-in-place", storage_path={storage!r}, verbose=0,
                         failure_config=FailureConfig(max_failures=1, recovery="in_place"))).fit()
""", RAY_ADDRESS=cluster.address)
    try:
        name = remove_for_good(cluster, read_marker(fifo, driver, "rank 2 to block after report 6"))
        read_until(driver, "STEP 7")  # the run goes on with 2 ranks
        add_back(cluster, name)
        _, err = driver.communicate(timeout=240)
    finally:
        end_on_two_nodes(cluster, driver)
    assert driver.returncode == 0, err
    result = Result.from_path(os.path.join(storage, "shrink-in-place"))
    first, second, third = attempts(result)
    assert "rank 2 (of the ray engine) was lost with its node" in first["error"], first["error"]
    # Ranks 0 and 1 stay, or, where gloo's ring left one blocked on the other (which stays
    # and keeps its connections), that one is started again after 2 s (exact-resume.md).
    peer = second["in_place"]
    assert (peer["iteration"], peer["dropped"], sorted(peer["kept"] + peer["replaced"])) == (6, [2], [0, 1])
    assert peer["source"] in peer["kept"] and len(peer["replaced"]) <= 1, peer
    assert (second["num_workers"], second["elastic"]["reason"], second["status"]) == \
        (2, "node lost", "RESIZED")
    assert second["resumed_from"] is None and first.get("jit_checkpoint") is None, \
        "nothing went through storage"
    assert all((pid_dir / f"rank{r}-a1").read_text() == (pid_dir / f"rank{r}-a2").read_text()
               for r in peer["kept"]), "the ranks that stayed kept their processes"
    assert (third["num_workers"], third["elastic"]["reason"]) == (3, "capacity returned"), third
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        cli.main(["show", result.path])
    shown = shown.getvalue()
    assert "went on without rank(s) 2 of attempt 1 (lost with their node)" in shown, shown
    rows = result.metrics_dataframe
    assert rows["training_iteration"].tolist() == list(range(1, len(rows) + 1)), "each iteration once"
    workers = {a["number"]: a["num_workers"] for a in (first, second, third)}
    made = [(attempt, len(losses)) for attempt, losses in zip(rows["attempt"], rows["losses"], strict=True)
            if isinstance(losses, list)]
    assert [n for _, n in made[:6]] == [3] * 6 and {a for a, _ in made} == {1, 2, 3}, made
    assert all(n == workers[a] for a, n in made), "each row made by its attempt's workers"
    seen: dict[int, list[int]] = {}
    before_growth: dict[int, list[int]] = {}
    columns = rows["training_iteration"], rows["epoch"], rows["indices"]
    for iteration, epoch, indices in zip(*columns, strict=True):
        if isinstance(indices, list):
            taken = [i for batch in indices for i in batch]
            seen.setdefault(int(epoch), []).extend(taken)
            if iteration <= third["resumed_iteration"]:
                before_growth.setdefault(int(epoch), []).extend(taken)
    # Each sample once per epoch; a segment that 3 ranks share unevenly is padded with repeats
    # (as torch's DistributedSampler pads): the rest of an epoch after the growth may be one.
    for epoch in range(epochs):
        assert set(seen[epoch]) == set(range(BASE["samples"])), (epoch, seen[epoch])
        assert len(seen[epoch]) - BASE["samples"] < 3, (epoch, seen[epoch])
        before = before_growth.get(epoch, [])
        assert len(set(before)) == len(before), "no sample twice in an epoch before the growth"


# -- preemption --------------------------------------------------------------------------

def drain_node_of(cluster, pid: int, deadline: float | None) -> tuple[str, str]:
    """Ray drains the node that runs process `pid` for preemption (deadline: time.time()
    seconds, None: none), as the autoscaler does for a spot reclaim; returns (node id, name)."""
    from ray.core.generated import autoscaler_pb2

    node = next(a["Address"]["NodeID"] for a in ray._private.state.actors().values()
                if a["Pid"] == pid and a["State"] == "ALIVE")
    name = next(k for k in ("node_a", "node_b", "node_c") if node_named(k) == node)
    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    accepted, why = ray._raylet.GcsClient(address=cluster.gcs_address).drain_node(
        node, reason, "spot reclaim", int(deadline * 1000) if deadline else 0)
    assert accepted, why
    return node, name


def start_drained_run(cluster, storage: str, name: str, num_workers, pid_dir):
    """Start run `name` of `exact_loop` on the Ray engine (just-in-time checkpoints, 0.5 s
    steps, each rank's pid in `pid_dir`, max_failures=0) in a driver process of its own."""
    return start_script(f"""
from test_exact_resume import BASE, exact_loop
from unbroken.train import FailureConfig, RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer
TorchTrainer(exact_loop, train_loop_config={{**BASE, "jit": True, "echo": True, "step_s": 0.5,
                                             "pid_dir": {str(pid_dir)!r}}},
             scaling_config=ScalingConfig(num_workers={num_workers!r}, engine="ray"),
             run_config=RunConfig(name={name!r}, storage_path={storage!r}, verbose=0,
                                  failure_config=FailureConfig(max_failures=0))).fit()
""", RAY_ADDRESS=cluster.address)


def drain_rank_1_node(cluster, driver, pid_dir) -> tuple[int, str, str, float, threading.Timer]:
    """Once the run has reported step 3, Ray drains rank 1's node 8 s ahead, and the node is
    removed at that deadline: (rank 1's pid, node id, node name, deadline, the removal's timer)."""
    read_until(driver, "STEP 3")
    pid = int((pid_dir / "rank1-a1").read_text())
    deadline = time.time() + 8
    node, name = drain_node_of(cluster, pid, deadline)
    gone = threading.Timer(deadline - time.time(), reclaim, (cluster, node))
    gone.start()
    return pid, node, name, deadline, gone


def reclaim(cluster, node_id: str) -> None:
    """The cloud takes a drained node back: remove it without warning, unless Ray already ended
    it (a drained node with nothing left on it exits)."""
    node = next((n for n in cluster.list_all_nodes() if n.node_id == node_id), None)
    if node is not None:
        cluster.remove_node(node, allow_graceful=False)


def test_a_drained_node_s_ranks_checkpoint_and_the_run_goes_on_without_it_bit_for_bit(
        cluster, storage, tmp_path):
    """Ray drains rank 1's node for preemption (a spot reclaim, 8 s ahead; node_c has joined as
    a spare): the ranks checkpoint at their next report and stop, and the next attempt runs
    without that node, which is removed at the deadline, as a cloud removes it, while the run
    goes on. With max_failures=0 the run finishes (a preemption is not a failure): the first
    attempt PREEMPTED, naming the node, each iteration once, nothing redone, and bit for bit
    the run on the local engine that was never preempted."""
    _add_node(cluster, "node_c", cluster.node_env)
    cluster.wait_for_nodes()
    local = jit_run("local", storage, "drain-local")
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    driver = start_drained_run(cluster, storage, "drained", 2, pid_dir)
    removed = None
    try:
        pid, node, removed, deadline, gone = drain_rank_1_node(cluster, driver, pid_dir)
        out, err = driver.communicate(timeout=240)
        gone.join()
    finally:
        gone_too = driver.poll() is None
        end_on_two_nodes(cluster, driver)
        if removed not in (None, "node_c"):
            add_back(cluster, removed)
            cluster.wait_for_nodes()
    assert driver.returncode == 0 and not gone_too, err[-3000:]
    result = Result.from_path(os.path.join(storage, "drained"))
    first, second = attempts(result)
    assert first["status"] == "PREEMPTED", first
    assert (first["preempted"]["source"], first["preempted"]["node"], first["preempted"]["ranks"]) == \
        ("ray drain", node, [1])
    assert first["preempted"]["deadline"] == pytest.approx(deadline, abs=0.01)
    rows = result.metrics_dataframe
    assert rows["training_iteration"].tolist() == list(range(1, len(rows) + 1)), "each iteration once"
    last = max(i for i, a in zip(rows["training_iteration"], rows["attempt"], strict=True) if a == 1)
    assert second["resumed_from"] == f"checkpoint_{last:06d}", "nothing redone"
    assert int((pid_dir / "rank1-a2").read_text()) != pid
    assert_same_run(result, local, "Ray engine, rank 1's node drained and then removed, vs local")


def test_an_elastic_run_shrinks_off_a_drained_node_at_a_checkpoint(cluster, storage, tmp_path):
    """num_workers=(1, 2) on node_a and node_b: Ray drains rank 1's node, 8 s ahead, and the node
    is removed abruptly at the deadline while the run goes on. The ranks checkpoint at their
    next report and stop, and the next attempt runs on 1 worker, not placed on the drained node
    (Ray refuses new actors there, and the capacity count leaves it out). Each iteration once,
    nothing redone."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    driver = start_drained_run(cluster, storage, "drained-elastic", (1, 2), pid_dir)
    name = None
    try:
        _, node, name, deadline, gone = drain_rank_1_node(cluster, driver, pid_dir)
        _, err = driver.communicate(timeout=240)
        gone.join()
    finally:
        if driver.poll() is None:
            driver.kill()
        if name is not None:  # the cluster as it was: a node like the one that went joins
            reclaim(cluster, node)
            add_back(cluster, name)
            cluster.wait_for_nodes()
    assert driver.returncode == 0, err[-3000:]
    result = Result.from_path(os.path.join(storage, "drained-elastic"))
    first, second = attempts(result)
    assert (first["status"], first["num_workers"], first["preempted"]["ranks"]) == ("PREEMPTED", 2, [1])
    assert (second["status"], second["num_workers"]) == ("FINISHED", 1), second
    rows = result.metrics_dataframe
    assert rows["timestamp"].max() > deadline, "the run was still training when the node went"
    assert rows["training_iteration"].tolist() == list(range(1, len(rows) + 1)), "each iteration once"
    last = max(i for i, a in zip(rows["training_iteration"], rows["attempt"], strict=True) if a == 1)
    assert second["resumed_from"] == f"checkpoint_{last:06d}", "nothing redone"


# -- sweeps --------------------------------------------------------------------------------


# 18 s: the default run's sweep on Ray (a lost node's trial, 21-36 s, is a soak)
def test_a_sweep_runs_its_trials_on_the_cluster_and_restores(cluster, storage, tmp_path):
    from unbroken import tune

    base = TorchTrainer(placed_loop, train_loop_config={"iterations": 3, "dir": str(tmp_path)},
                        scaling_config=ScalingConfig(num_workers=1, engine="ray"),
                        run_config=RunConfig(checkpoint_config=CheckpointConfig(num_to_keep=1)))
    tuner = tune.Tuner(base, param_space={"train_loop_config": {"lr": tune.grid_search([0.1, 0.2, 0.3])}},
                       tune_config=tune.TuneConfig(max_concurrent_trials=2),
                       run_config=RunConfig(name="sweep", storage_path=storage, verbose=0))
    grid = tuner.fit()
    assert len(grid) == 3 and not grid.errors
    assert all(r.metrics["training_iteration"] == 3 for r in grid)
    workers = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")}
    assert placements_of(str(tmp_path), 1)[0]["node_id"] in workers  # trials' ranks ran as actors
    assert all(final_weights(r) for r in grid)
    assert tune.Tuner.restore(os.path.join(storage, "sweep"), base).fit().num_terminated == 3


@pytest.mark.slow  # 21-36 s; the default run places a sweep's trials on Ray above
def test_a_lost_node_costs_only_the_trial_placed_on_it_its_progress_since_its_checkpoint(
        cluster, storage, tmp_path, capsys):
    """Two trials, each pinned whole (its driver actor and its worker) to one node. node_b is
    removed while its trial is at iteration 3, past its checkpoint at 2: that trial's driver
    is relaunched on the node that replaces it and resumes from checkpoint 2; the trial on
    node_a never notices. Each iteration once in both."""
    marker = str(tmp_path / "hung")
    fifo = marker_fifo(marker)
    sweep = start_script(f"""
from ray_loops import pinned_loop
from unbroken import tune
from unbroken.train import RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer

def pinned(node):
    return ScalingConfig(num_workers=1, engine="ray", resources_per_worker={{"CPU": 1, node: 0.01}},
                         trainer_resources={{node: 0.01}})

base = TorchTrainer(pinned_loop, train_loop_config={{"iterations": 6, "ckpt_every": 1, "hang_at": [3, 1],
                                                    "hang_marker": {marker!r}, "faults_on": "node_b"}},
                    scaling_config=ScalingConfig(num_workers=1, engine="ray"))
space = {{"scaling_config": tune.grid_search([pinned("node_a"), pinned("node_b")])}}
grid = tune.Tuner(base, param_space=space,
                  tune_config=tune.TuneConfig(max_concurrent_trials=2),
                  run_config=RunConfig(name="lost-trial", storage_path={storage!r}, verbose=0)).fit()
print("ERRORS", [str(e).splitlines()[0] for e in grid.errors])
""", RAY_ADDRESS=cluster.address)
    read_marker(fifo, sweep, "the trial on node_b to block at iteration 3")
    lost = node_named("node_b")
    replace_node(cluster, lost)
    out, err = sweep.communicate(timeout=180)
    assert sweep.returncode == 0 and "ERRORS []" in out, out.split("ERRORS")[-1][:2000]
    path = os.path.join(storage, "lost-trial")
    on_a, on_b = sweep_json(path)["trials"]
    assert on_a["status"] == on_b["status"] == "TERMINATED"
    for record in (on_a, on_b):
        assert record["driver"]["pid"] != os.getpid(), "each trial's driver was an actor, not this process"
        rows = [json.loads(line) for line in open(os.path.join(path, record["name"], "result.json"))]
        timeline = {r["training_iteration"]: r for r in rows}
        assert sorted(timeline) == list(range(1, 7))
    assert on_a["relaunches"] == 0 and len(attempts_at(os.path.join(path, on_a["name"]))) == 1
    assert on_b["relaunches"] == 1 and on_b["driver"]["node_id"] not in (lost, on_a["driver"]["node_id"])
    assert on_a["driver"]["node_id"] == node_named("node_a")
    first, second = attempts_at(os.path.join(path, on_b["name"]))
    assert first["status"] != "FINISHED" and second["resumed_from"] == "checkpoint_000002"
    assert "lost" in err and "runs again from its last checkpoint" in err
    from unbroken.cli.commands import main

    assert main(["show", path]) == 0
    shown = capsys.readouterr().out
    assert f"{on_b['driver']['address']}:{on_b['driver']['pid']}" in shown, "LOC: where each driver ran"
    assert "ran again 1x after its driver's node was lost" in shown


def signalled_trainer(marker: str) -> TorchTrainer:
    """Marks iteration 3 of attempt 1 and the first report of attempt 2 in the FIFO `marker`."""
    from loops import linear_loop

    first_of_second = [[it, 2] for it in range(1, 13)]
    config = {"iterations": 12, "ckpt_every": 2, "step_s": 0.5, "signal_at": [[3, 1]] + first_of_second,
              "signal_marker": marker}
    return TorchTrainer(linear_loop, train_loop_config=config, scaling_config=ScalingConfig(num_workers=1))


SIGNALLED_SWEEP = """
import sys
from test_ray_engine import signalled_trainer
from unbroken import tune
from unbroken.errors import TrainingInterruptedError
from unbroken.train import RunConfig

base = signalled_trainer(sys.argv[2])
try:
    tune.Tuner(base, param_space={"train_loop_config": {"lr": tune.grid_search([0.1])}},
               run_config=RunConfig(name="signalled", storage_path=sys.argv[1], verbose=0)).fit()
    print("FINISHED")
except TrainingInterruptedError:
    print("INTERRUPTED")
"""


@pytest.mark.slow  # 30 s; the default run has the lost trial driver above
def test_a_sigterm_reaches_trial_drivers_on_their_nodes_and_a_sigkill_takes_them_along(
        cluster, storage, tmp_path):
    """SIGTERM to the sweep driver: forwarded to the trial's driver on its node, which
    checkpoints and stops. SIGKILL to the next one: the trial's driver process ends with it
    (Ray ends the trial's actor, PDEATHSIG its process). A restore then finishes the trial,
    each iteration once."""
    from unbroken import tune

    marker = str(tmp_path / "marker")
    path = os.path.join(storage, "signalled")
    fifo = marker_fifo(marker)
    sweep = start_script(SIGNALLED_SWEEP, storage, marker, RAY_ADDRESS=cluster.address)
    assert read_marker(fifo, sweep, "iteration 3") == "3"
    sweep.send_signal(signal.SIGTERM)
    out, err = sweep.communicate(timeout=120)
    assert "INTERRUPTED" in out, err[-3000:]
    (trial,) = sweep_json(path)["trials"]
    assert trial["status"] == "INTERRUPTED" and trial["driver"]["pid"] != sweep.pid
    assert [a["status"] for a in attempts_at(os.path.join(path, trial["name"]))] == ["PREEMPTED"]

    fifo = os.open(marker, os.O_RDONLY | os.O_NONBLOCK)
    sweep = start_script(SIGNALLED_SWEEP, storage, marker, RAY_ADDRESS=cluster.address)
    resumed_at = int(read_marker(fifo, sweep, "the restored trial's first report"))
    assert 4 <= resumed_at < 12
    (trial,) = sweep_json(path)["trials"]
    sweep.kill()
    sweep.communicate()
    wait_ended([trial["driver"]["pid"]], "the trial's driver to end with its sweep driver", timeout=60)
    grid = tune.Tuner.restore(path, signalled_trainer(marker)).fit()
    (result,) = grid
    assert [r["training_iteration"] for r in result.rows] == list(range(1, 13))
    assert [a["status"] for a in attempts(result)][::2] == ["PREEMPTED", "FINISHED"]


@pytest.mark.slow  # 30 s; TrialSlots' arithmetic is unit-tested in test_elastic
def test_elastic_trials_share_the_cluster_by_what_each_holds_now(cluster, storage):
    """Two elastic trials (1 to 2 workers) on three 1-CPU nodes, both allowed at once: the first
    takes 2 workers, the second starts beside it on the 1 slot left (it is not counted at its
    most), and grows to 2 once the first has finished. Each iteration once in both."""
    from loops import linear_loop
    from unbroken import tune

    _add_node(cluster, "node_c", cluster.node_env)
    cluster.wait_for_nodes()
    try:
        config = {"step_s": 0.25, "ckpt_every": 10, "on_request": True}
        base = TorchTrainer(linear_loop, train_loop_config=config,
                            scaling_config=ScalingConfig(num_workers=(1, 2), engine="ray",
                                                         elastic_resize_monitor_interval_s=1))
        grid = tune.Tuner(base, param_space={"train_loop_config": {"iterations": tune.grid_search([30, 60])}},
                          tune_config=tune.TuneConfig(max_concurrent_trials=2),
                          run_config=RunConfig(name="elastic-sweep", storage_path=storage, verbose=0)).fit()
    finally:
        extra = node_named("node_c")
        if extra is not None:
            cluster.remove_node(next(n for n in cluster.list_all_nodes() if n.node_id == extra),
                                allow_graceful=False)
    assert not grid.errors and len(grid) == 2
    first, second = sorted(grid, key=lambda r: r.metrics["training_iteration"])
    assert [r["training_iteration"] for r in first.rows] == list(range(1, 31))
    assert [r["training_iteration"] for r in second.rows] == list(range(1, 61))
    (only,) = attempts_at(first.path)
    assert only["num_workers"] == 2
    attempts = attempts_at(second.path)
    assert attempts[0]["num_workers"] == 1, "the second trial started on the slot the first left free"
    assert attempts[0]["started_at"] < only["ended_at"], "... while the first still ran"
    assert (attempts[-1]["num_workers"], attempts[-1]["elastic"]["reason"]) == (2, "capacity returned")
    assert attempts[-1]["started_at"] >= only["ended_at"]


def test_a_validation_is_a_ray_task_with_the_given_options(cluster, storage):
    """ValidationConfig.ray_remote_kwargs place the validation task: here on node_b only."""
    from unbroken.train import DataParallelTrainer, ValidationConfig, ValidationTaskConfig
    from validation_loops import validate_where, validation_loop

    options = {"num_cpus": 0, "resources": {"node_b": 0.1}}  # the workers hold the nodes' CPUs
    validation = ValidationConfig(validate_where, ray_remote_kwargs=options,
                                  task_config=ValidationTaskConfig(fn_kwargs={"marker_env": OTHER_ROOT}))
    config = {"iterations": 2, "asks": {"2": "yes"}}
    result = DataParallelTrainer(validation_loop, train_loop_config=config, validation_config=validation,
                                 scaling_config=ScalingConfig(num_workers=2, engine="ray"),
                                 run_config=RunConfig(name="validated", storage_path=storage)).fit()
    assert [status for _, status, _, _ in result.return_value] == ["COMMITTED", "VALIDATED"]
    validated = result.best_checkpoints[-1][1]
    assert validated["val"] == 2 and validated["ran_there"] is True
