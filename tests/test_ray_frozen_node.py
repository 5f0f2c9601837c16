"""A node that freezes instead of dying (every process of it SIGSTOPped: a hung machine or a
network partition, which keeps its connections open) on a real multi-node Ray cluster.

The cluster is this module's own: its head checks node health every 0.5 s and declares a
node dead after 3 missed checks of 1 s each, so that the test takes seconds instead of
Ray's default (5 checks of 10 s each, which took about 65 s here). The bound on recovery is
Ray's: a frozen node's ranks count as lost when Ray declares the node dead.
"""

from __future__ import annotations

import json
import os
import signal
import uuid

import pytest

ray = pytest.importorskip("ray")

from conftest import run_script, s3_env, start_script  # noqa: E402
from test_ray_engine import NODE, marker_fifo, placements_of, read_marker, wait_ended  # noqa: E402

# Its own 3-node cluster costs about 35 s: a soak; the default run checks frozen ranks locally
# (test_preemption's hung-rank tests).
pytestmark = [pytest.mark.ray, pytest.mark.slow]

HEALTH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
          "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}


@pytest.fixture(scope="module")
def cluster(s3_endpoint):
    """A head with no CPUs and three one-CPU nodes: two for the ranks, one to replace a lost one."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                      "object_store_memory": NODE["object_store_memory"],
                                                      "_system_config": HEALTH})
    for _ in range(3):
        c.add_node(**NODE, env_vars=s3_env(s3_endpoint))
    c.wait_for_nodes()
    yield c
    c.shutdown()


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it."""
    found = [pid]
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            for child in open(f"/proc/{pid}/task/{task}/children").read().split():
                found += process_tree(int(child))
    except OSError:
        pass
    return found


def frozen_until_done(cluster, node_id: str, driver) -> tuple[str, str, list[int]]:
    """Stop every process of node `node_id` until `driver` ends, then let them go on; returns
    the driver's output and error, and the processes that were stopped."""
    node = next(n for n in cluster.list_all_nodes() if n.node_id == node_id)
    frozen = process_tree(node.all_processes["raylet"][0].process.pid)
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        out, err = driver.communicate(timeout=240)
    finally:
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    return out, err, frozen


DRIVER = """
import sys
from test_ray_engine import trainer
result = trainer(sys.argv[1], "frozen", sys.argv[2], max_failures=1, ckpt_every=1, hang_timeout_s=None,
                 rank_files=True, hang_at=[3, 1], hang_marker=sys.argv[3], hang_by_sigstop=True).fit()
print("ROWS", result.metrics_dataframe["training_iteration"].tolist())
"""

CHECK = """
import json, sys
from unbroken.store import commit
from unbroken.store.storage import Storage
run = Storage.from_url(sys.argv[1])
names, leftovers = commit.scan(run)
out = {"leftovers": leftovers, "checkpoints": {}}
for name in names:
    try:
        commit.verify(run, name, full=True)
        out["checkpoints"][name] = json.loads(run.read_bytes(name + "/rank1.json"))
    except Exception as e:
        out["checkpoints"][name] = f"{type(e).__name__}: {e}"
print("STORED", json.dumps(out))
"""


def test_a_frozen_node_is_lost_the_run_finishes_and_the_node_never_rejoins(cluster, s3_endpoint, tmp_path):
    """Rank 1's process stops itself at iteration 3 (before its checkpoint report), then every
    process of its node is stopped. The run must go on without a hang_timeout_s, on the spare
    node; once the node is let go on (SIGCONT), rank 1 must not write its checkpoint files:
    on S3 they would land under the name of a checkpoint the next attempt has committed."""
    storage = f"s3://bucket/frozen-{uuid.uuid4().hex[:8]}"
    env = s3_env(s3_endpoint)
    fifo = marker_fifo(str(tmp_path / "stopped"))
    driver = start_script(DRIVER, storage, str(tmp_path), str(tmp_path / "stopped"),
                          RAY_ADDRESS=cluster.address, **env)
    rank1 = int(read_marker(fifo, driver, "rank 1 to stop itself"))
    frozen_node = placements_of(str(tmp_path), 1, 2)[1]["node_id"]
    out, err, frozen = frozen_until_done(cluster, frozen_node, driver)
    assert rank1 in frozen, "rank 1 runs on that node"
    assert driver.returncode == 0, err[-3000:]
    assert json.loads(out.split("ROWS", 1)[1].splitlines()[0]) == list(range(1, 9))
    attempts = json.loads(run_script(
        "import sys; from unbroken.store.storage import Storage; "
        "print(Storage.from_url(sys.argv[1]).read_bytes('.unbroken/run.json').decode())",
        f"{storage}/frozen", **env).stdout)["attempts"]
    first, second = attempts
    assert first["status"] == "ERRORED" and "died" in first["error"], first["error"]
    assert second["resumed_from"] == "checkpoint_000002" and second["status"] == "FINISHED"
    assert frozen_node not in {r["node_id"] for r in placements_of(str(tmp_path), 2, 2)}

    # Let go on, the stale rank finds its attempt over and ends without writing.
    wait_ended([rank1], "the frozen rank to end after SIGCONT", timeout=60)
    stored = json.loads(run_script(CHECK, f"{storage}/frozen", **env).stdout.split("STORED ", 1)[1])
    assert stored["leftovers"] == []
    assert sorted(stored["checkpoints"]) == [f"checkpoint_{i:06d}" for i in range(1, 9)]
    for name, rank1_file in stored["checkpoints"].items():
        iteration = int(name.rsplit("_", 1)[1])
        expected = {"attempt": 1 if iteration < 3 else 2, "iteration": iteration}
        assert rank1_file == expected, (name, rank1_file)


def test_the_survivor_of_a_frozen_node_is_released_at_its_collective_timeout_and_stays(cluster, tmp_path):
    """recovery="in_place" with hang_timeout_s: rank 1 blocks after report 6, then its node freezes,
    keeping its connections open, so rank 0 stays blocked in its all-reduce after Ray declared
    the node dead. torch.distributed's collective timeout is 1.5 times the hang bound in such a
    run: rank 0's all-reduce fails there, rank 0 offers round 6 and stays, and rank 1 starts again
    on the spare node. Bit for bit with the uninterrupted run on the local engine."""
    from test_exact_resume import assert_same_run
    from test_ray_engine import jit_run
    from unbroken.train import Result

    # A spare for rank 1: a test before may have frozen a node for good (add_node waits for it).
    cluster.add_node(**NODE)
    storage, pid_dir, marker = str(tmp_path / "runs"), tmp_path / "pids", str(tmp_path / "hung")
    pid_dir.mkdir()
    fifo = marker_fifo(marker)
    driver = start_script(f"""
from test_ray_engine import jit_run
jit_run("ray", {storage!r}, "frozen-in-place", in_place=True, hang_timeout_s=8, pid_dir={str(pid_dir)!r},
        die_after_report=[[6, 1, 1, "hang"]], hang_marker={marker!r})
""", RAY_ADDRESS=cluster.address)
    blocked_on = read_marker(fifo, driver, "rank 1 to block after report 6")  # rank 1's node
    _, err, _ = frozen_until_done(cluster, blocked_on, driver)
    assert driver.returncode == 0, err[-3000:]
    result = Result.from_path(os.path.join(storage, "frozen-in-place"))
    first, second = json.load(open(os.path.join(result.path, ".unbroken", "run.json")))["attempts"]
    assert "lost with its node" in first["error"], first["error"]
    assert second["in_place"] == {"iteration": 6, "source": 0, "kept": [0], "replaced": [1]}, second
    assert second["resumed_from"] is None and first.get("jit_checkpoint") is None
    assert (pid_dir / "rank0-a1").read_text() == (pid_dir / "rank0-a2").read_text(), "rank 0 stayed"
    assert_same_run(result, jit_run("local", storage, "frozen-local"),
                    "Ray engine, rank 1's node frozen, recovered in place")
