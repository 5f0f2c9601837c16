"""The Ray engine against the local engine and Ray Train V1, on one local 2-node Ray cluster.

    python benchmarks/bench_ray.py [--repeats N]

Starts `ray.cluster_utils.Cluster` (a head with no CPUs, two nodes with one CPU each) and runs
every job in a fresh Python process (benchmarks/_ray_job.py), 2 workers with one CPU each:

1. fit() to the first line of the training loop (the slowest rank).
2. train.report(metrics) without a checkpoint: per call on rank 0, 200 calls after a warm-up.
3. Recovery after rank 1's process is SIGKILLed: from the kill to the next attempt's first row.
4. Recovery after rank 1's node is removed (`Cluster.remove_node`, then a replacement node is
   added): from the removal to the next attempt's first row (not for the local engine).
5. 3 and 4 again for unbroken with the loop's state in a TrainState with just-in-time
   checkpoints (`kill+jit`, `node+jit`): the survivor saves the last report's state, so no
   reported iteration is redone.

Ray Train V1 runs with RAY_TRAIN_V2_ENABLED=0 and trainer_resources={"CPU": 0}. Recovery jobs
take 40 ms a step, checkpoint every 50 iterations and fail during the compute of iteration 303
(some 12 s into the run, after the restart was warmed up), the same in all three, so the
iterations redone (reported before the failure and run again) are the same by construction
(2), except with just-in-time checkpoints (0). `--tasks` picks the measurements. Prints a
markdown table of medians (min-max).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "_ray_job.py")
FRAMEWORKS = ("local", "unbroken-ray", "ray-v1")
STARTUP = {"warmup": 20, "reports": 200}
RECOVERY = {"iterations": 320, "every": 50, "fail_at": 303, "step_s": 0.04}
MB = 2**20
TASKS = ("startup", "kill", "node", "kill+jit", "node+jit")
TARGETS = {"first_line_s": 0.3, "report_ms": 0.1, "kill": 0.3, "node": 0.3}  # × Ray V1


def start_cluster():
    """The cluster, with `names`: node id -> the node's name (its custom resource)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                            "object_store_memory": 80 * MB})
    cluster.names = {}
    for name in ("node_a", "node_b"):
        add_node(cluster, name)
    cluster.wait_for_nodes()
    return cluster


def add_node(cluster, name: str) -> None:
    node = cluster.add_node(num_cpus=1, resources={name: 1}, object_store_memory=80 * MB)
    cluster.names[node.node_id] = name


def run_job(cluster, framework: str, task: str, root: str, timeout: float) -> dict | None:
    work = tempfile.mkdtemp(prefix=f"{framework}-{task}-", dir=root)
    env = dict(os.environ, PYTHONUNBUFFERED="1", UNBROKEN_STORAGE=os.path.join(root, "default"))
    env.pop("RAY_ADDRESS", None)
    if framework != "local":
        env["RAY_ADDRESS"] = cluster.address
    task, _, variant = task.partition("+")
    params = STARTUP if task == "startup" else dict(RECOVERY, jit=variant == "jit")
    proc = subprocess.Popen([sys.executable, JOB, framework, task, work, json.dumps(params)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=work)
    if task == "node":
        lose = os.path.join(work, "lose")
        deadline = time.monotonic() + timeout
        while not os.path.exists(lose) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if os.path.exists(lose):
            remove_and_replace(cluster, json.load(open(lose))["node_id"], work)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        print(f"[bench] {framework}/{task} timed out", file=sys.stderr)
        return None
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((out + err).splitlines()[-20:])
        print(f"[bench] {framework}/{task} failed ({proc.returncode}):\n{tail}", file=sys.stderr)
        return None
    return json.loads(lines[-1][len("RESULT "):])


def remove_and_replace(cluster, node_id: str, work: str) -> None:
    """Take the node away without warning, note when, and add a node like it."""
    node = next(n for n in cluster.list_all_nodes() if n.node_id == node_id)
    at = time.time()
    cluster.remove_node(node, allow_graceful=False)
    with open(os.path.join(work, "removed"), "w") as f:
        json.dump({"at": at}, f)
    add_node(cluster, cluster.names.pop(node_id))


def fmt(values: list[float], unit: str, digits: int = 2) -> str:
    if not values:
        return "failed"
    med = statistics.median(values)
    spread = f" ({min(values):.{digits}f}–{max(values):.{digits}f})" if len(values) > 1 else ""
    return f"{med:.{digits}f} {unit}{spread}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--tasks", default=",".join(TASKS),
                        help=f"comma-separated, of {', '.join(TASKS)}")
    args = parser.parse_args(argv)
    import ray

    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-ray-") as root:
        cluster = start_cluster()
        try:
            for i in range(args.repeats):
                for task in args.tasks.split(","):
                    for fw in FRAMEWORKS:
                        if not runs(fw, task):
                            continue
                        out = run_job(cluster, fw, task, root, args.timeout)
                        if out is not None:
                            results.setdefault((fw, task), []).append(out)
                print(f"[bench] repeat {i + 1}/{args.repeats} done", file=sys.stderr, flush=True)
        finally:
            cluster.shutdown()
    print(render(results, args.repeats, ray.__version__, args.tasks.split(",")))
    return 0


def runs(framework: str, task: str) -> bool:
    """Whether `task` is measured for `framework`: no node loss on the local engine, and no
    just-in-time checkpoints in Ray Train V1."""
    return not ((framework == "local" and task.startswith("node")) or
                (framework == "ray-v1" and task.endswith("+jit")))


def render(results: dict, repeats: int, ray_version: str, tasks: list[str] | tuple[str, ...] = TASKS) -> str:
    def values(fw: str, task: str, key: str) -> list[float]:
        return [r[key] for r in results.get((fw, task), []) if key in r]

    rows = [("fit() → first line of the loop (slowest rank)", "startup", "first_line_s", "s", 2),
            ("train.report(metrics), no checkpoint, per call (rank 0)", "startup", "report_ms", "ms", 3),
            ("recovery: rank SIGKILLed → next attempt's first row", "kill", "recovery_s", "s", 2),
            ("recovery: node removed → next attempt's first row", "node", "recovery_s", "s", 2),
            ("iterations redone after the kill", "kill", "redone", "", 0),
            ("with just-in-time checkpoints: recovery after the kill", "kill+jit", "recovery_s", "s", 2),
            ("with just-in-time checkpoints: recovery after the node's removal", "node+jit",
             "recovery_s", "s", 2),
            ("with just-in-time checkpoints: iterations redone after the kill", "kill+jit", "redone", "", 0),
            ("with just-in-time checkpoints: iterations redone after the node's removal", "node+jit",
             "redone", "", 0)]
    lines = [f"## Ray engine — {repeats} repeats, 2 workers (1 CPU each) on a local 2-node Ray "
             f"{ray_version} cluster, {os.cpu_count()} CPUs", "",
             "| Measurement | local engine | unbroken, Ray engine | Ray Train V1 "
             "| Ray engine vs V1 (target) |",
             "|---|---|---|---|---|"]
    for label, task, key, unit, digits in (row for row in rows if row[1] in tasks):
        cells = [fmt(values(fw, task, key), unit, digits) if runs(fw, task) else "—" for fw in FRAMEWORKS]
        base = task.partition("+")[0]  # V1 has no just-in-time checkpoints: against its plain run
        ours, v1 = values("unbroken-ray", task, key), values("ray-v1", base, key)
        target = TARGETS.get(key if task == "startup" else base) if key != "redone" else None
        ratio = "—"
        if ours and v1 and target is not None and statistics.median(v1) > 0:
            r = statistics.median(ours) / statistics.median(v1)
            ratio = f"{r:.3f} × (≤ {target:g} ×: {'PASS' if r <= target else 'FAIL'})"
        lines.append(f"| {label} | {' | '.join(cells)} | {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
