"""Goodput under one seeded failure trace: unbroken (local engine and Ray engine, each also with
just-in-time checkpoints) against Ray Train V1 and V2 on the same local 2-node Ray cluster.

    python benchmarks/bench_goodput.py [--repeats N] [--mtbf 15] [--iterations 3000] [--seed 0]

The same job in each (benchmarks/_goodput_job.py): 2 workers of 1 CPU, 40 ms steps, a
checkpoint every 50, `--iterations` of them (120 s without failures), max_failures=-1. While
it runs, the failure trace strikes: rank 1's process is SIGKILLed at exponentially
distributed times (mean `--mtbf` seconds from the job's start, the same seeded times for
every job), and on the Ray cluster the fifth failure is instead the loss of rank 1's node
(removed without warning, a node like it added at once). Goodput is computed the same way
for all: the iterations × the failure-free step time / fit()'s wall time, where the
failure-free step time is the fastest framework's median time between two reports in a
250-step run without failures (so a framework's slower reports count against it too).
Prints a markdown table of medians (min-max) and, with `--plot FILE`, draws the last
unbroken Ray run with just-in-time checkpoints (`unbroken plot --goodput`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from bench_ray import add_node, fmt, start_cluster

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "_goodput_job.py")
FRAMEWORKS = ("local", "local+jit", "unbroken-ray", "unbroken-ray+jit", "ray-v1", "ray-v2")
NODE_LOSS = 4  # the fifth failure is a node loss on the Ray cluster
TARGET = 0.90


def trace(seed: int, mtbf: float, horizon: float) -> list[float]:
    """The failure times (seconds from the job's start), exponentially distributed."""
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(1 / mtbf)
        if t > horizon:
            return out
        out.append(t)


def run_job(cluster, framework: str, root: str, params: dict, times: list[float],
            timeout: float) -> dict | None:
    """Run one job while the failure trace `times` strikes it (in this thread: Ray's cluster
    utilities add nodes only from the main thread)."""
    work = tempfile.mkdtemp(prefix=f"{framework}-", dir=root)
    env = dict(os.environ, PYTHONUNBUFFERED="1", UNBROKEN_STORAGE=os.path.join(root, "default"))
    env.pop("RAY_ADDRESS", None)
    if not framework.startswith("local"):
        env["RAY_ADDRESS"] = cluster.address
    log = os.path.join(work, "log.txt")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, JOB, framework, work, json.dumps(params)], env=env,
                                stdout=out, stderr=subprocess.STDOUT, text=True, cwd=work)
    started, struck, pending = time.time(), {"kills": 0, "nodes": 0}, list(enumerate(times))
    while proc.poll() is None and time.time() < started + timeout:
        if not pending or time.time() < started + pending[0][1]:
            time.sleep(0.05)
            continue
        rank = _running_rank(work)
        if rank is None:  # between attempts: strike the next one as soon as it runs
            time.sleep(0.05)
            continue
        index, _ = pending.pop(0)
        if index == NODE_LOSS and not framework.startswith("local"):
            node = next(n for n in cluster.list_all_nodes() if n.node_id == rank["node_id"])
            cluster.remove_node(node, allow_graceful=False)
            add_node(cluster, cluster.names.pop(rank["node_id"]))
            struck["nodes"] += 1
        else:
            os.kill(rank["pid"], signal.SIGKILL)
            struck["kills"] += 1
        os.remove(os.path.join(work, "rank1.json"))
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    text = open(log).read()
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(text.splitlines()[-20:])
        print(f"[bench] {framework} failed ({proc.returncode}):\n{tail}", file=sys.stderr)
        return None
    stamps = [json.loads(line)["t"] for line in open(os.path.join(work, "rows.jsonl"))]
    step = statistics.median(b - a for a, b in zip(stamps, stamps[1:], strict=False))
    result = dict(json.loads(lines[-1][len("RESULT "):]), rows=len(stamps), step_s=step, **struck, work=work)
    print(f"[bench] {framework}: {result}", file=sys.stderr, flush=True)
    return result


def _running_rank(work: str) -> dict | None:
    """Rank 1 of the attempt running now (its pid and node), or None between attempts."""
    try:
        rank = json.load(open(os.path.join(work, "rank1.json")))
        os.kill(rank["pid"], 0)
        return rank
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--mtbf", type=float, default=15.0)
    parser.add_argument("--iterations", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    parser.add_argument("--plot", help="draw the last unbroken-ray+jit run's goodput into this PNG")
    args = parser.parse_args(argv)
    import ray

    params = {"iterations": args.iterations, "step_s": 0.04, "every": 50}
    frameworks = args.frameworks.split(",")
    clean: dict[str, float] = {}
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-goodput-") as root:
        cluster = start_cluster()
        try:
            for fw in frameworks:  # the failure-free step time of each
                out = run_job(cluster, fw, root, dict(params, iterations=250), [], 600)
                if out is not None:
                    clean[fw] = out["step_s"]
            horizon = 10 * args.iterations * params["step_s"]
            for repeat in range(args.repeats):
                times = trace(args.seed + repeat, args.mtbf, horizon)
                for fw in frameworks:
                    out = run_job(cluster, fw, root, params, times, 3 * horizon)
                    if out is not None:
                        results.setdefault(fw, []).append(out)
                        if fw == "unbroken-ray+jit" and args.plot:
                            subprocess.run([sys.executable, "-m", "unbroken", "plot", "--goodput", "-o",
                                            args.plot, os.path.join(out["work"], "storage", "bench")],
                                           check=False)
        finally:
            cluster.shutdown()
            shutil.rmtree(root, ignore_errors=True)
    print(render(results, clean, args, ray.__version__))
    return 0


def render(results: dict[str, list[dict]], clean: dict[str, float], args: argparse.Namespace,
           ray_version: str) -> str:
    step = min(clean.values()) if clean else 0.04
    chosen = args.frameworks.split(",")

    def goodput(fw: str) -> list[float]:
        return [args.iterations * step / r["fit_s"] for r in results.get(fw, [])]

    lines = [f"## Goodput under failures — {args.repeats} repeat(s), 2 workers (1 CPU each), local 2-node "
             f"Ray {ray_version} cluster, {os.cpu_count()} CPUs; {args.iterations} steps, failures every "
             f"{args.mtbf:g} s on average (seed {args.seed})", "",
             "| | " + " | ".join(chosen) + " |", "|---|" + "---|" * len(chosen)]
    def row(label: str, cell) -> None:
        lines.append(f"| {label} | " + " | ".join(cell(fw) for fw in chosen) + " |")
    row("failure-free step", lambda fw: f"{1000 * clean[fw]:.1f} ms" if fw in clean else "—")
    row("wall time", lambda fw: fmt([r["fit_s"] for r in results.get(fw, [])], "s", 1))
    row("failures (kills + node losses)",
        lambda fw: fmt([r["kills"] + r["nodes"] for r in results.get(fw, [])], "", 0))
    row("iterations redone",
        lambda fw: fmt([r["rows"] - args.iterations for r in results.get(fw, [])], "", 0))
    row("goodput", lambda fw: fmt(goodput(fw), "", 3))
    best_ray = max((statistics.median(goodput(fw)) for fw in ("ray-v1", "ray-v2") if goodput(fw)),
                   default=None)
    engines = (("locally", ("local+jit", "local")), ("on Ray", ("unbroken-ray+jit", "unbroken-ray")))
    for engine, candidates in engines:
        ours = next((goodput(fw) for fw in candidates if goodput(fw)), None)
        if ours:
            ratio = (f", {statistics.median(ours) / best_ray:.2f} × the better Ray version's"
                     if best_ray else "")
            lines += ["", f"unbroken {engine}: goodput {statistics.median(ours):.3f} (target ≥ {TARGET}: "
                          f"{'PASS' if statistics.median(ours) >= TARGET else 'FAIL'}){ratio}."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
