"""Elastic training under a node outage: unbroken elastic, unbroken fixed-size and Ray Train V2
elastic, side by side on one local Ray cluster.

    python benchmarks/bench_elastic.py [--repeats N] [--outage S] [--frameworks a,b,...]

Starts `ray.cluster_utils.Cluster` (a head with no CPUs, three nodes with one CPU each) and runs
each job in a fresh Python process (benchmarks/_elastic_job.py): a tiny DDP loop of 0.1 s steps,
a checkpoint every 20 steps, rank 0 logging every report. Once a job has reported 30 rows on 3
workers, and 15 s after its first (a node is rarely lost in an attempt's first seconds, and
unbroken keeps spares warm from 10 s on), the node of its last rank is removed without
warning; `--outage` seconds later (40) a node like it is added back; once the job has
reported 30 rows on 3 workers again (or 180 s passed) it is told to stop. From the log:

- shrink: node removed -> the next attempt's first row (on fewer workers, for an elastic run;
  after the node's return, for the fixed-size run);
- iterations completed during the outage, and the throughput then against before the loss
  (target: >= 0.9 x 2/3);
- iterations redone: reported again after the loss (target with just-in-time checkpoints: 0);
- grow: node back -> first row on 3 workers.

Ray Train V2 runs with RAY_TRAIN_V2_ENABLED=1 and the same monitor interval (5 s). Prints a
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
JOB = os.path.join(HERE, "_elastic_job.py")
FRAMEWORKS = ("unbroken-elastic", "unbroken-elastic+jit", "unbroken-fixed", "ray-v2-elastic")
PARAMS = {"step_s": 0.1, "every": 20, "monitor_s": 5.0}
ROWS = 30  # on 3 workers, before the node is removed, and again after it is back
SETTLE_S = 15.0  # from the first row on 3 workers to the node's removal, at least
MB = 2**20


def start_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                            "object_store_memory": 80 * MB})
    for _ in range(3):
        cluster.add_node(num_cpus=1, object_store_memory=80 * MB)
    cluster.wait_for_nodes()
    return cluster


def rows(work: str) -> list[dict]:
    try:
        with open(os.path.join(work, "rows.jsonl")) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def wait_rows(work: str, proc, count: int, after: float, timeout: float) -> bool:
    """Poll the job's log until it has `count` rows on 3 workers after time `after`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if sum(1 for r in rows(work) if r["ws"] == 3 and r["t"] > after) >= count:
            return True
        time.sleep(0.1)
    return False


def run_job(cluster, framework: str, root: str, outage: float) -> dict | None:
    work = tempfile.mkdtemp(prefix=f"{framework}-", dir=root)
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_ADDRESS=cluster.address)
    proc = subprocess.Popen([sys.executable, JOB, framework, work, json.dumps(PARAMS)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=work)
    result = None
    try:
        if not wait_rows(work, proc, ROWS, 0.0, 300):
            raise RuntimeError("the job did not reach 3 workers")
        first = min(r["t"] for r in rows(work) if r["ws"] == 3)
        time.sleep(max(0.0, first + SETTLE_S - time.time()))
        last = max(int(n[5:-5]) for n in os.listdir(work) if n.startswith("node-"))
        node_id = json.load(open(os.path.join(work, f"node-{last}.json")))["node_id"]
        lost_at = time.time()
        cluster.remove_node(next(n for n in cluster.list_all_nodes() if n.node_id == node_id),
                            allow_graceful=False)
        time.sleep(outage)
        back_at = time.time()
        cluster.add_node(num_cpus=1, object_store_memory=80 * MB)
        grew = wait_rows(work, proc, ROWS, back_at, 180)
        result = measure(rows(work), lost_at, back_at, grew)
    except Exception as e:  # noqa: BLE001 - a failed job is reported, the others still run
        print(f"[bench] {framework} failed: {e}", file=sys.stderr)
    finally:
        open(os.path.join(work, "stop"), "w").close()
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        if result is None:
            print("\n".join((out + err).splitlines()[-15:]), file=sys.stderr)
        while len([n for n in cluster.list_all_nodes() if not n.head]) < 3:
            cluster.add_node(num_cpus=1, object_store_memory=80 * MB)
        cluster.wait_for_nodes()
    return result


def measure(log: list[dict], lost_at: float, back_at: float, grew: bool) -> dict:
    """The figures of one job from rank 0's log: rows of the attempt that was running when
    the node went (its process) are told apart from the next attempts' by their pid."""
    old = {r["pid"] for r in log if r["t"] < lost_at}
    window = [r for r in log if lost_at - 10 <= r["t"] < lost_at and r["ws"] == 3]
    new = [r for r in log if r["t"] >= lost_at and r["pid"] not in old]
    during = [r for r in new if r["t"] < back_at]
    seen, redone = {r["it"] for r in log if r["t"] < lost_at}, 0
    for r in new:
        redone += r["it"] in seen
        seen.add(r["it"])
    rate_before = (len(window) - 1) / (window[-1]["t"] - window[0]["t"]) if len(window) > 1 else 0.0
    rate_during = (len(during) - 1) / (during[-1]["t"] - during[0]["t"]) if len(during) > 1 else 0.0
    first = min((r["t"] for r in new), default=None)
    out = {"shrink_s": first - lost_at if first is not None else None,
           "outage_iterations": len({r["it"] for r in during}), "redone": redone,
           "throughput": rate_during / rate_before if rate_before else 0.0,
           "shrunk_to": min((r["ws"] for r in during), default=None)}
    grown = [r["t"] for r in new if r["t"] >= back_at and r["ws"] == 3]
    if grew and grown:
        out["grow_s"] = min(grown) - back_at
    return out


def fmt(values: list[float], unit: str = "", digits: int = 1) -> str:
    if not values:
        return "—"
    med = statistics.median(values)
    spread = f" ({min(values):.{digits}f}–{max(values):.{digits}f})" if len(values) > 1 else ""
    return f"{med:.{digits}f}{unit}{spread}"


def render(results: dict[str, list[dict]], repeats: int, outage: float, ray_version: str) -> str:
    frameworks = [f for f in FRAMEWORKS if f in results]

    def col(key: str, unit: str = "", digits: int = 1) -> list[str]:
        return [fmt([r[key] for r in results[f] if r.get(key) is not None], unit, digits) for f in frameworks]

    lines = [f"## Elastic training — {repeats} repeat(s), a 3-node local Ray {ray_version} cluster "
             f"(1 CPU each), one node removed for {outage:g} s, {os.cpu_count()} CPUs", "",
             "| Measurement | " + " | ".join(frameworks) + " |", "|---" * (len(frameworks) + 1) + "|"]
    for label, key, unit, digits in (
            ("node removed → next attempt's first row", "shrink_s", " s", 1),
            ("workers during the outage", "shrunk_to", "", 0),
            ("iterations completed during the outage", "outage_iterations", "", 0),
            ("steps/s during the outage ÷ before (target ≥ 0.9 × 2/3 = 0.6)", "throughput", "", 2),
            ("iterations redone", "redone", "", 0),
            ("node back → first row on 3 workers", "grow_s", " s", 1)):
        lines.append(f"| {label} | " + " | ".join(col(key, unit, digits)) + " |")
    ours = [r["shrink_s"] for r in results.get("unbroken-elastic", [])]
    ray = [r["shrink_s"] for r in results.get("ray-v2-elastic", [])]
    if ours and ray:
        ratio = statistics.median(ours) / statistics.median(ray)
        lines += ["", f"Shrink, unbroken elastic ÷ Ray V2 elastic: {ratio:.3f} × (target ≤ 0.1 ×: "
                      f"{'PASS' if ratio <= 0.1 else 'FAIL'})"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--outage", type=float, default=40.0)
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    args = parser.parse_args(argv)
    import ray

    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-elastic-") as root:
        cluster = start_cluster()
        try:
            for i in range(args.repeats):
                for fw in args.frameworks.split(","):
                    out = run_job(cluster, fw, root, args.outage)
                    print(f"[bench] {fw}: {out}", file=sys.stderr, flush=True)
                    if out is not None:
                        results.setdefault(fw, []).append(out)
                print(f"[bench] repeat {i + 1}/{args.repeats} done", file=sys.stderr, flush=True)
        finally:
            cluster.shutdown()
    print(render(results, args.repeats, args.outage, ray.__version__))
    return 0


if __name__ == "__main__":
    sys.exit(main())
