"""Recovery from a killed rank: today's restart against in-place recovery, by state size.

    python benchmarks/bench_recovery.py [--repeats N] [--sizes 10,200,1024]

A 2-rank DDP job on the local engine whose model and optimizer state is 10 MiB, 200 MiB and
1 GiB (a linear layer and SGD momentum), with `TrainState(jit_checkpoint=True)`; rank 1 is
SIGKILLed right after report 8 (benchmarks/_recovery_job.py). Both modes resume at report 8,
nothing is redone, and the restart is warm (UNBROKEN_WARM_UP_AFTER_S=0: the workers start
from a forkserver with torch imported); they differ in how the state comes back:

- restart: a survivor saves the state just in time, the driver commits it, every rank is
  started again and loads it from storage;
- in place (`FailureConfig(recovery="in_place")`): the survivor keeps its process, rank 1
  starts again, and the survivor sends it the state over the new process group;
- in the loop: in place, with the loop in `TrainState.for_each_batch`: the survivor does not
  even leave it (its model, optimizer and loader stay), and redoes the step.

Measured: the time from the kill to the next row, the bytes the next attempt reads from
storage (the checkpoint it loads, on every rank), and whether the survivor kept its process.
Prints a markdown table of medians (min-max).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "_recovery_job.py")
MODES = ("restart", "in-place", "in-loop")
KILL_AFTER, ITERATIONS = 8, 12


def run_job(size_mib: int, mode: str) -> dict:
    work = tempfile.mkdtemp(prefix=f"unbroken-recovery-{mode}-")
    try:
        env = dict(os.environ, UNBROKEN_WARM_UP_AFTER_S="0", PYTHONUNBUFFERED="1")
        subprocess.run([sys.executable, JOB, work, str(size_mib), mode, str(KILL_AFTER), str(ITERATIONS)],
                       env=env, check=True, cwd=HERE, capture_output=True, text=True)
        return measure(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure(work: str) -> dict:
    rows = [json.loads(line) for line in open(os.path.join(work, "rows.jsonl"))]
    killed = json.load(open(os.path.join(work, "killed")))["t"]
    first = min(r["t"] for r in rows if r["attempt"] == 2)
    pid = {(r, a): json.load(open(os.path.join(work, f"pid-r{r}-a{a}")))["pid"]
           for r in (0, 1) for a in (1, 2)}
    run = os.path.join(work, "storage", "run")
    attempt = json.load(open(os.path.join(run, ".unbroken", "run.json")))["attempts"][1]
    read = 0
    if attempt["resumed_from"]:
        checkpoint = os.path.join(run, attempt["resumed_from"])
        read = 2 * sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(checkpoint) for f in fs)
    return {"recovery_s": first - killed, "read_mib": read / 2**20,
            "kept": pid[(0, 1)] == pid[(0, 2)], "redone": sum(1 for r in rows if r["attempt"] == 2
                                                              and r["it"] <= KILL_AFTER)}


def fmt(values: list[float], digits: int = 2) -> str:
    med = statistics.median(values)
    return f"{med:.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})" if len(values) > 1 \
        else f"{med:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", default="10,200,1024", help="state sizes in MiB")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict[tuple[int, str], list[dict]] = {}
    for repeat in range(args.repeats):
        for size in sizes:
            for mode in MODES:
                r = run_job(size, mode)
                results.setdefault((size, mode), []).append(r)
                print(f"[bench] {size} MiB {mode}: {r}", file=sys.stderr, flush=True)
        print(f"[bench] repeat {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    print(f"## Recovery from a killed rank — 2 ranks, {args.repeats} repeat(s), {os.cpu_count()} CPUs\n")
    print("| State | Restart: kill → next row | In place | In the loop | In place ÷ restart | In the loop "
          "÷ restart | Read from storage: restart / in place / in the loop | Survivor kept its process |")
    print("|---|---|---|---|---|---|---|---|")
    for size in sizes:
        by = {mode: results[(size, mode)] for mode in MODES}
        median = {mode: statistics.median(r["recovery_s"] for r in rs) for mode, rs in by.items()}
        read = " / ".join(f"{statistics.median(r['read_mib'] for r in by[mode]):.0f} MiB" for mode in MODES)
        kept = f"{sum(r['kept'] for m in MODES[1:] for r in by[m])} of {sum(len(by[m]) for m in MODES[1:])}"
        times = " | ".join(f"{fmt([r['recovery_s'] for r in by[mode]])} s" for mode in MODES)
        ratios = " | ".join(f"{median[mode] / median['restart']:.2f} ×" for mode in MODES[1:])
        print(f"| {size} MiB | {times} | {ratios} | {read} | {kept} |")
    redone = sum(r["redone"] for rs in results.values() for r in rs)
    print(f"\nIterations redone, all jobs: {redone}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
