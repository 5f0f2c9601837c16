"""Core performance benchmarks for unbroken (SPEC section 6), side by side with plain
torch.distributed and, when `import ray` works, Ray Train.

    python benchmarks/bench_core.py [--repeats N] [--quick]

Every measurement runs in a fresh Python process (benchmarks/_core_job.py), whose driver
imports torch and the framework at its top as a training script does, with 2 local workers:

1. fit() to the first line of the training loop (the slowest of the 2 ranks).
2. train.report(metrics) without a checkpoint: per-call cost on rank 0, in a tight loop.
   (Measured in the same processes as 1, after the first line has been timed.)
3. A small real training job (MLP regression, DDP via prepare_model, a DataLoader via
   prepare_data_loader, a torch.save checkpoint from rank 0 every epoch), end to end, against
   the same job as a plain torch.distributed script (workers forked with
   torch.multiprocessing, gloo, same model, data, steps and checkpoints). Whole-process wall
   time and the in-loop time (first step to after the last epoch's checkpoint) are reported.

OMP_NUM_THREADS is set to cpu_count // 2 for every job, and the plain workers call
torch.set_num_threads with the same number, as unbroken does for its workers. All files go
to a temporary directory that is removed at the end. Prints a markdown table of medians
(with min-max) and a breakdown of where the end-to-end time goes.
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
JOB = os.path.join(HERE, "_core_job.py")
NUM_WORKERS = 2

TARGET_FIRST_LINE_S = 1.0
TARGET_REPORT_MS = 0.5
TARGET_E2E_RATIO = 1.03


def job_params(quick: bool) -> tuple[dict, dict]:
    """(startup job params, training job params)."""
    if quick:
        return ({"warmup": 20, "reports": 500},
                {"samples": 6000, "in_dim": 64, "hidden": 256, "batch_size": 64, "epochs": 2})
    return ({"warmup": 50, "reports": 2000},
            {"samples": 16000, "in_dim": 64, "hidden": 256, "batch_size": 64, "epochs": 3})


def child_env(root: str) -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // NUM_WORKERS))
    env["UNBROKEN_STORAGE"] = os.path.join(root, "default_storage")  # never ~/unbroken_results
    env["RAY_TMPDIR"] = os.path.join(root, "ray_tmp")  # Ray's session dirs go away with root
    env["RAY_AIR_LOCAL_CACHE_DIR"] = os.path.join(root, "ray_results")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def ray_version(env: dict) -> str | None:
    proc = subprocess.run([sys.executable, "-c", "import ray; print(ray.__version__)"],
                          capture_output=True, text=True, env=env)
    return proc.stdout.strip() if proc.returncode == 0 else None


def run_job(framework: str, task: str, params: dict, root: str, env: dict, timeout: float) -> dict | None:
    """Run one job in a fresh process; its numbers plus `wall_s` and `import_s`, or None."""
    work = tempfile.mkdtemp(prefix=f"{framework}-{task}-", dir=root)
    if framework == "ray":
        os.makedirs(env["RAY_TMPDIR"], exist_ok=True)
    launched = time.time()
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, JOB, framework, task, work, json.dumps(params)],
                              capture_output=True, text=True, env=env, timeout=timeout, cwd=work)
    except subprocess.TimeoutExpired:
        print(f"[bench] {framework}/{task} timed out after {timeout:.0f} s", file=sys.stderr)
        return None
    wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
        print(f"[bench] {framework}/{task} failed (exit {proc.returncode}):\n{tail}", file=sys.stderr)
        return None
    out = json.loads(lines[-1][len("RESULT "):])
    out["wall_s"] = wall
    out["import_s"] = out.pop("imported_at") - launched
    return out


# -- formatting ------------------------------------------------------------------------------------
def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def fmt(values: list[float], unit: str, scale: float = 1.0, digits: int = 2) -> str:
    if not values:
        return "failed"
    vals = [v * scale for v in values]
    med = statistics.median(vals)
    if len(vals) == 1:
        return f"{med:.{digits}f} {unit}"
    return f"{med:.{digits}f} {unit} ({min(vals):.{digits}f}–{max(vals):.{digits}f})"


def verdict(value: float | None, limit: float, fmt_value: str) -> str:
    if value is None:
        return "n/a"
    return f"{fmt_value}: {'PASS' if value <= limit else 'FAIL'}"


def collect(results: list[dict | None], key: str) -> list[float]:
    return [r[key] for r in results if r is not None and key in r]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs of each measurement; the table shows medians (default 5, --quick 3)")
    parser.add_argument("--quick", action="store_true", help="3 repeats of smaller jobs")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed for one job")
    parser.add_argument("--no-ray", action="store_true", help="skip Ray Train even if it is installed")
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 5)
    startup_params, train_params = job_params(args.quick)

    with tempfile.TemporaryDirectory(prefix="unbroken-bench-") as root:
        env = child_env(root)
        ray = None if args.no_ray else ray_version(env)
        frameworks = ["unbroken"] + (["ray"] if ray else [])
        # Untimed warm-up: the first process to import torch (and ray) pays for a cold page cache.
        warm = "import torch, unbroken.train.torch" + (", ray.train.torch" if ray else "")
        subprocess.run([sys.executable, "-c", warm], env=env, check=True, cwd=root)

        startup: dict[str, list] = {fw: [] for fw in frameworks}
        trained: dict[str, list] = {fw: [] for fw in ["plain"] + frameworks}
        began = time.perf_counter()
        for i in range(repeats):
            for fw in frameworks:
                startup[fw].append(run_job(fw, "startup", startup_params, root, env, args.timeout))
            order = ["plain"] + frameworks
            order = order[i % len(order):] + order[:i % len(order)]  # rotate: no fixed first job
            for fw in order:
                trained[fw].append(run_job(fw, "train", train_params, root, env, args.timeout))
            print(f"[bench] repeat {i + 1}/{repeats} done ({time.perf_counter() - began:.0f} s)",
                  file=sys.stderr, flush=True)

    print(render(startup, trained, ray, repeats, startup_params, train_params, args.quick))
    return 0


def render(startup: dict, trained: dict, ray: str | None, repeats: int, startup_params: dict,
           train_params: dict, quick: bool) -> str:
    no_ray = "Ray not installed"
    ray_col = f"Ray Train {ray}" if ray else "Ray Train"

    def ray_cell(results: dict, key: str, unit: str, scale: float = 1.0, digits: int = 2) -> str:
        return fmt(collect(results["ray"], key), unit, scale, digits) if ray else no_ray

    first = collect(startup["unbroken"], "first_line_s")
    report = collect(startup["unbroken"], "report_ms")
    e2e_u, e2e_p = collect(trained["unbroken"], "wall_s"), collect(trained["plain"], "wall_s")
    loop_u, loop_p = collect(trained["unbroken"], "in_loop_s"), collect(trained["plain"], "in_loop_s")
    # Ratio of medians, and the median of the per-repeat ratios (paired runs, less noise).
    ratio = median(e2e_u) / median(e2e_p) if e2e_u and e2e_p else None
    pairs = [u["wall_s"] / p["wall_s"]
             for u, p in zip(trained["unbroken"], trained["plain"], strict=True) if u and p]
    loop_ratio = median(loop_u) / median(loop_p) if loop_u and loop_p else None

    threads = max(1, (os.cpu_count() or 1) // NUM_WORKERS)
    steps = -(-train_params["samples"] // NUM_WORKERS // train_params["batch_size"]) * train_params["epochs"]
    lines = [
        f"## unbroken core benchmarks — {repeats} repeats{' (--quick)' if quick else ''}, "
        f"{NUM_WORKERS} workers, {os.cpu_count()} CPUs, OMP_NUM_THREADS={threads}, "
        f"Python {sys.version.split()[0]}",
        "",
        "Medians, (min–max) over the repeats; every run is a fresh process.",
        "",
        f"| Measurement | Target | unbroken | plain torch.distributed | {ray_col} | unbroken vs target |",
        "|---|---|---|---|---|---|",
        f"| fit() → first line of the loop (slowest rank) | ≤ {TARGET_FIRST_LINE_S:g} s "
        f"| {fmt(first, 's')} | — | {ray_cell(startup, 'first_line_s', 's')} "
        f"| {verdict(median(first), TARGET_FIRST_LINE_S, f'{median(first) or 0:.2f} s')} |",
        f"| train.report(metrics), no checkpoint, per call ({startup_params['reports']} calls, rank 0) "
        f"| ≤ {TARGET_REPORT_MS:g} ms | {fmt(report, 'ms', digits=3)} | — "
        f"| {ray_cell(startup, 'report_ms', 'ms', digits=3)} "
        f"| {verdict(median(report), TARGET_REPORT_MS, f'{median(report) or 0:.3f} ms')} |",
        f"| Training job end to end: process start → exit | ≤ {TARGET_E2E_RATIO:g} × plain "
        f"| {fmt(e2e_u, 's')} | {fmt(e2e_p, 's')} | {ray_cell(trained, 'wall_s', 's')} "
        f"| {verdict(ratio, TARGET_E2E_RATIO, f'{ratio or 0:.3f} × plain')}"
        f"{f' (paired median {median(pairs):.3f} ×)' if pairs else ''} |",
        f"| Training job in-loop: first step → after last epoch's checkpoint (rank 0) | — "
        f"| {fmt(loop_u, 's')} | {fmt(loop_p, 's')} | {ray_cell(trained, 'in_loop_s', 's')} "
        f"| {f'{loop_ratio:.3f} × plain' if loop_ratio else 'n/a'} |",
        "",
        "Where the end-to-end time goes (medians):",
        "",
        f"| Phase | unbroken | plain torch.distributed | {ray_col} |",
        "|---|---|---|---|",
    ]
    frameworks = ["unbroken", "plain", "ray"]

    def row(label: str, values_of) -> str:
        cells = []
        for fw in frameworks:
            if fw == "ray" and not ray:
                cells.append(no_ray)
                continue
            vals = [v for v in (values_of(r) for r in trained[fw] if r is not None) if v is not None]
            cells.append(fmt(vals, "s"))
        return f"| {label} | " + " | ".join(cells) + " |"

    lines += [
        row("interpreter start → torch + framework imported", lambda r: r["import_s"]),
        row("fit() / fork → first training step (slowest rank)", lambda r: r["to_first_step_s"]),
        row("in-loop (first step → last checkpoint)", lambda r: r["in_loop_s"]),
        row("last checkpoint → fit() / workers' join returns",
            lambda r: r["fit_s"] - r["to_first_step_s"] - r["in_loop_s"]),
        row("rest: building the trainer; fit() returns → process exit",
            lambda r: r["wall_s"] - r["import_s"] - r["fit_s"]),
        "",
        f"Training job: MLP {train_params['in_dim']}→{train_params['hidden']}→{train_params['hidden']}→1, "
        f"{train_params['samples']} samples, batch {train_params['batch_size']} per rank, "
        f"{train_params['epochs']} epochs ({steps} steps per rank), Adam, DDP over gloo, "
        "a torch.save checkpoint (model + optimizer) from rank 0 after every epoch. "
        "Plain workers are forked with torch.multiprocessing.start_processes(start_method='fork').",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
