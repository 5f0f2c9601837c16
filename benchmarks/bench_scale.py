"""Scale benchmarks: what costs grow with a run's or a sweep's history (docs/guarantees.md).

    python benchmarks/bench_scale.py [--reports 200000] [--checkpoints 5000] [--trials 512]
                                     [--runs 1000] [--only reports,checkpoints,sweep,ls]

Each measurement runs in a fresh Python process (this file with --job), on local disk in a
temporary directory:

1. reports: one worker reports N times (no checkpoint). The per-report cost is timed in
   ten windows; the table compares the median of the first three with the last three. Then the run's stored
   history is opened three ways: `Result.from_path`, `unbroken show` (a fresh process), and
   a restore that resumes at the last row and finishes (`Trainer.restore(path).fit()`).
2. checkpoints: one worker reports N times, each with a checkpoint (one small file), through
   retention with num_to_keep=2: the cost of a report with its commit and its retention
   delete, first tenth against last.
3. sweep: a Tuner of N trials of one report each (2 at a time): wall time per trial, and the
   sweep driver's peak memory (max RSS), against a sweep of N/16 trials.
4. ls: `unbroken ls` over a directory of N finished runs, against N/10 runs.

Prints a markdown table; figures are single runs (these take minutes), medians where a step
is repeated.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
WINDOWS = 10
S3_CKPT_EVERY = 100  # S3 run: a checkpoint (and so a sync of result.json) every this many reports


# -- the jobs (each in its own process) --------------------------------------------------------
def report_loop(config: dict) -> None:
    """Reports `n` times (each with a one-file checkpoint when `checkpoint`, or every
    `ckpt_every`-th); writes to `out` the mean seconds per report of each tenth and the
    seconds each report with a checkpoint took."""
    from unbroken import train
    from unbroken.train import Checkpoint

    if config.get("resume_only"):
        return
    n, start = config["n"], 0
    window, marks, commits = max(1, n // WINDOWS), [time.perf_counter()], []
    every = 1 if config.get("checkpoint") else config.get("ckpt_every")
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "state.txt"), "w") as f:
            f.write("x" * 64)
        for it in range(start + 1, n + 1):
            if every and it % every == 0:
                t0 = time.perf_counter()
                train.report({"it": it, "loss": 1.0 / it}, checkpoint=Checkpoint.from_directory(d))
                commits.append(time.perf_counter() - t0)
            else:
                train.report({"it": it, "loss": 1.0 / it})
            if it % window == 0:
                marks.append(time.perf_counter())
    with open(config["out"], "w") as f:
        windows = [(b - a) / window for a, b in zip(marks, marks[1:], strict=False)]
        json.dump({"windows": windows, "commits": commits}, f)


def one_report(config: dict) -> None:
    from unbroken import tune

    tune.report({"score": config["x"]})


def job_reports(root: str, n: int, checkpoint: bool, ckpt_every: int | None = None) -> dict:
    from unbroken.train import CheckpointConfig, DataParallelTrainer, Result, RunConfig, ScalingConfig

    out = os.path.join(tempfile.mkdtemp(), "windows.json")
    name = "checkpoints" if checkpoint or ckpt_every else "reports"
    keep = CheckpointConfig(num_to_keep=2) if checkpoint or ckpt_every else None
    t0 = time.perf_counter()
    config = {"n": n, "out": out, "checkpoint": checkpoint, "ckpt_every": ckpt_every}
    result = DataParallelTrainer(
        report_loop, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=1),
        run_config=RunConfig(name=name, storage_path=root, verbose=0, checkpoint_config=keep)).fit()
    timed = json.load(open(out))
    figures = {"fit_s": time.perf_counter() - t0, "windows_s": timed["windows"],
               "commits_s": timed["commits"]}
    if checkpoint or ckpt_every:
        return figures
    t0 = time.perf_counter()
    assert len(Result.from_path(result.url).metrics_dataframe) == n
    figures["result_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "unbroken", "show", result.url], check=True,
                   capture_output=True)
    figures["show_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    DataParallelTrainer.restore(result.url, train_loop_config=dict(config, resume_only=True)).fit()
    figures["restore_fit_s"] = time.perf_counter() - t0
    return figures


def job_sweep(root: str, n: int) -> dict:
    from unbroken import tune
    from unbroken.train import RunConfig

    t0 = time.perf_counter()
    grid = tune.Tuner(one_report, param_space={"x": tune.grid_search(list(range(n)))},
                      tune_config=tune.TuneConfig(max_concurrent_trials=2),
                      run_config=RunConfig(name="sweep", storage_path=root, verbose=0)).fit()
    wall = time.perf_counter() - t0
    assert len(grid) == n and not grid.errors
    return {"wall_s": wall, "per_trial_s": wall / n,
            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def job(argv: list[str]) -> None:
    kind, root, n = argv[0], argv[1], int(argv[2])
    if kind == "sweep":
        figures = job_sweep(root, n)
    elif kind == "s3":
        figures = job_reports(root, n, checkpoint=False, ckpt_every=S3_CKPT_EVERY)
    else:
        figures = job_reports(root, n, checkpoint=kind == "checkpoints")
    print("FIGURES " + json.dumps(figures), flush=True)


# -- the driver --------------------------------------------------------------------------------
def run_job(kind: str, root: str, n: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, HERE, "--job", kind, root, str(n)], env=env,
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} job failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.split("FIGURES ", 1)[1].splitlines()[0])


def time_ls(root: str, runs: int, template: str) -> float:
    """Median seconds of `unbroken ls` over `runs` copies of the finished run `template`."""
    where = os.path.join(root, f"ls-{runs}")
    for i in range(runs):
        shutil.copytree(template, os.path.join(where, f"run-{i:05d}"))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "unbroken", "ls", where], check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def s3_history(n: int) -> tuple[str, ...]:
    """A run of `n` reports on an S3-compatible server (moto, started on loopback), with a
    checkpoint every S3_CKPT_EVERY (each syncs the history before it commits): per-report
    cost, first tenth against last."""
    script = os.path.join(os.path.dirname(os.path.dirname(HERE)), "tools", "s3_server.py")
    server = subprocess.Popen([sys.executable, script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        port = server.stdout.readline().split()[1]
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                          AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
        import boto3

        boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}").create_bucket(Bucket="bench")
        windows = run_job("s3", "s3://bench/scale", n)["windows_s"]
    finally:
        server.stdin.close()
        server.wait()
    early, late = early_late(windows)
    return (f"S3: train.report, {n:,} reports, a checkpoint every {S3_CKPT_EVERY}",
            "per report, first 3 tenths", early, "last 3 tenths", late)


def early_late(windows: list[float]) -> tuple[str, str]:
    """The median per-report cost of the first three tenths and of the last three."""
    return ms(statistics.median(windows[:3])), ms(statistics.median(windows[-3:]))


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--reports", type=int, default=200_000)
    parser.add_argument("--checkpoints", type=int, default=5_000)
    parser.add_argument("--trials", type=int, default=512)
    parser.add_argument("--runs", type=int, default=1_000)
    parser.add_argument("--s3-reports", type=int, default=20_000,
                        help=f"reports of the S3 run (a checkpoint every {S3_CKPT_EVERY})")
    parser.add_argument("--only", default="reports,checkpoints,sweep,ls,s3",
                        help="which measurements (s3 needs moto and s3fs)")
    args = parser.parse_args(argv)
    if args.job:
        job(args.job)
        return 0
    only = set(args.only.split(","))
    rows = []
    with tempfile.TemporaryDirectory(prefix="unbroken-scale-") as root:
        if "reports" in only:
            small = run_job("reports", os.path.join(root, "r-small"), max(WINDOWS, args.reports // 100))
            big = run_job("reports", os.path.join(root, "r-big"), args.reports)
            early, late = early_late(big["windows_s"])
            rows.append((f"train.report, {args.reports:,} reports", "per report, first 3 tenths", early,
                         "last 3 tenths", late))
            for key, label in (("result_s", "Result.from_path + metrics_dataframe"),
                               ("show_s", "`unbroken show` (a fresh process)"),
                               ("restore_fit_s", "restore + fit() (resumes at the last row)")):
                rows.append((label, f"{args.reports // 100:,} rows", f"{small[key]:.2f} s",
                             f"{args.reports:,} rows", f"{big[key]:.2f} s"))
        if "checkpoints" in only:
            timed = run_job("checkpoints", os.path.join(root, "c"), args.checkpoints)
            early, late = early_late(timed["windows_s"])
            rows.append((f"report + commit + retention (num_to_keep=2), {args.checkpoints:,} checkpoints",
                         "per report, first 3 tenths", early, "last 3 tenths", late))
        if "sweep" in only:
            few = max(2, args.trials // 16)
            small = run_job("sweep", os.path.join(root, "s-small"), few)
            big = run_job("sweep", os.path.join(root, "s-big"), args.trials)
            rows.append(("sweep, wall time per trial", f"{few} trials", f"{small['per_trial_s']:.3f} s",
                         f"{args.trials} trials", f"{big['per_trial_s']:.3f} s"))
            rows.append(("sweep driver's peak memory (max RSS)", f"{few} trials",
                         f"{small['max_rss_mb']:.0f} MB", f"{args.trials} trials",
                         f"{big['max_rss_mb']:.0f} MB"))
        if "ls" in only:
            template = os.path.join(root, "template")
            run_job("reports", template, 20)
            few = max(1, args.runs // 10)
            rows.append(("`unbroken ls`", f"{few} runs", f"{time_ls(root, few, template + '/reports'):.2f} s",
                         f"{args.runs:,} runs", f"{time_ls(root, args.runs, template + '/reports'):.2f} s"))
        if "s3" in only:
            rows.append(s3_history(args.s3_reports))
    print("| What | At | Cost | At | Cost |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
