"""A node drained for preemption, unbroken against Ray Train V2, on the same cluster and drain.

    python benchmarks/bench_preemption.py [--repeats N] [--deadline-s 10]

A local Ray cluster (`ray.cluster_utils.Cluster`: a head with no CPUs and three nodes with
one CPU each, one of them spare) runs the 2-rank job of benchmarks/_preemption_job.py with
`max_failures=0`: a report every 0.2 s step, a checkpoint every 10 steps and one when the
loop learns of the preemption. After report 15, Ray drains rank 1's node with a deadline
(`GcsClient.drain_node`, reason PREEMPTION, as the autoscaler and KubeRay do for a spot
reclaim); at the deadline the node is removed abruptly, as a cloud removes it, and a new
one joins for the next run. Measured per run:

- notice -> checkpoint: from the drain to the first checkpoint written after it (the newest
  file of its directory in storage: unbroken's commit marker, Ray's last file uploaded);
- notice -> row elsewhere: from the drain to the first report of a new process;
- redone: iterations reported twice;
- survived: whether fit() returned (a preemption must not count as a failure).

Ray is run with RAY_TRAIN_V2_ENABLED=1. Prints a markdown table of medians (min-max).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from bench_recovery import fmt as median_range

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "_preemption_job.py")
DRAIN_AFTER, ITERATIONS = 15, 60
MB = 2**20


def one_run(cluster, lib: str, deadline_s: float) -> dict:
    import ray
    from ray.core.generated import autoscaler_pb2

    work = tempfile.mkdtemp(prefix=f"unbroken-preemption-{lib}-")
    rows_file = os.path.join(work, "rows.jsonl")
    env = dict(os.environ, RAY_ADDRESS=cluster.address, PYTHONUNBUFFERED="1",
               **({"RAY_TRAIN_V2_ENABLED": "1"} if lib == "ray" else {}))
    job = subprocess.Popen([sys.executable, JOB, work, lib, str(ITERATIONS)], env=env, cwd=HERE,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while job.poll() is None and _reported(rows_file) < DRAIN_AFTER:
            time.sleep(0.05)  # polls the job's progress file
        node = open(os.path.join(work, "node-r1")).read().strip()
        notice = time.time()
        reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
        ray._raylet.GcsClient(address=cluster.gcs_address).drain_node(
            node, reason, "spot reclaim", int((notice + deadline_s) * 1000))
        while job.poll() is None and time.time() < notice + deadline_s:
            time.sleep(0.05)  # the deadline
        _reclaim(cluster, node)
        _, err = job.communicate(timeout=600)
        rows = [json.loads(line) for line in open(rows_file)]
        first_pids = {r["pid"] for r in rows if r["t"] < notice}
        saved = [t for t in _checkpoints_written(os.path.join(work, "storage", "run")) if t >= notice]
        elsewhere = [r["t"] for r in rows if r["pid"] not in first_pids]
        its = [r["it"] for r in rows]
        return {"checkpoint_s": min(saved) - notice if saved else None,
                "elsewhere_s": min(elsewhere) - notice if elsewhere else None,
                "redone": len(its) - len(set(its)),
                "survived": os.path.exists(os.path.join(work, "survived")), "error": err[-400:]}
    finally:
        if job.poll() is None:
            job.kill()
        shutil.rmtree(work, ignore_errors=True)


def _checkpoints_written(run: str) -> list[float]:
    """When each checkpoint directory of the run was last written to."""
    out = []
    for name in os.listdir(run) if os.path.isdir(run) else []:
        top = os.path.join(run, name)
        if name.startswith("checkpoint_") and os.path.isdir(top):
            out.append(max(os.path.getmtime(os.path.join(d, f)) for d, _, fs in os.walk(top) for f in fs))
    return out


def _reported(rows_file: str) -> int:
    try:
        with open(rows_file) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def _reclaim(cluster, node_id: str) -> None:
    """The cloud takes the node back (unless Ray ended it already) and a new one joins."""
    node = next((n for n in cluster.list_all_nodes() if n.node_id == node_id), None)
    if node is not None:
        cluster.remove_node(node, allow_graceful=False)
    cluster.add_node(num_cpus=1, object_store_memory=80 * MB)
    cluster.wait_for_nodes()


def fmt(values: list, digits: int = 2) -> str:
    """Median (min-max) of the values measured ("-" when none was)."""
    values = [v for v in values if v is not None]
    return median_range(values, digits) if values else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--deadline-s", type=float, default=10.0)
    parser.add_argument("--libs", default="unbroken,ray")
    args = parser.parse_args(argv)
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                            "object_store_memory": 80 * MB})
    for _ in range(3):
        cluster.add_node(num_cpus=1, object_store_memory=80 * MB)
    cluster.wait_for_nodes()
    results: dict[str, list[dict]] = {}
    try:
        for _ in range(args.repeats):
            for lib in args.libs.split(","):
                results.setdefault(lib, []).append(one_run(cluster, lib, args.deadline_s))
    finally:
        cluster.shutdown()
    print(f"deadline {args.deadline_s:.0f} s after the drain; {args.repeats} runs each; medians (min-max)\n")
    print("| | notice -> checkpoint (s) | notice -> row elsewhere (s) | iterations redone | survived "
          "max_failures=0 |")
    print("|---|---|---|---|---|")
    for lib, runs in results.items():
        name = "unbroken" if lib == "unbroken" else "Ray Train V2"
        survived = sum(r["survived"] for r in runs)
        checkpoint, elsewhere = fmt([r["checkpoint_s"] for r in runs]), fmt([r["elsewhere_s"] for r in runs])
        print(f"| {name} | {checkpoint} | {elsewhere} | {fmt([r['redone'] for r in runs], 0)} "
              f"| {survived} of {len(runs)} |")
    for lib, runs in results.items():
        for r in runs:
            if not r["survived"]:
                print(f"\n{lib} run failed: ...{r['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
