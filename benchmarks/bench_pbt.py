"""Population-based training: unbroken against Ray Tune, on the same trainable.

    python benchmarks/bench_pbt.py [--frameworks unbroken,unbroken-reuse,ray,ray-reuse]
                                   [--modes synch,async]
                                   [--repeats 1] [--kill-at 0.5]

The sweep (`_pbt_job.py`): 8 trials of a small linear model, 12 iterations of 40 SGD steps
each, a checkpoint at every report, 2 trials at a time, PBT every 3 iterations
(quantile 0.25, lr mutated from a list). `unbroken-reuse` and `ray-reuse` run with
`TuneConfig(reuse_actors=True)`; the others with the default (False in both).
For each framework it runs:

1. the same sweep without a scheduler (FIFO): wall time, and the overhead per trial (the
   wall time times the concurrency, less the compute the trainable measured, per trial);
2. the PBT sweep, in each mode (`synch=True`: decisions at a barrier, which unbroken
   restores bit for bit; `synch=False`, Ray's default): wall time, exploits, the overhead per
   exploit ((PBT wall - FIFO wall) / exploits), and the iterations run;
3. the PBT sweep with its whole process group SIGKILLed once `--kill-at` of the
   uninterrupted sweep's iterations have run (as a lost machine), then restored
   (`Tuner.restore(...).fit()`): the wall time of both launches, the iterations run in all
   (more than the uninterrupted sweep's: work run again; with `synch=False` the count also
   depends on which trials exploited which), and whether each trial ends with the
   uninterrupted sweep's config and score.

Each iteration the trainable runs appends a line to a log, so re-runs are counted the same
way for both. Prints a markdown table of medians over --repeats; each framework's raw
figures go to stderr as JSON as soon as it is done (`--from-log FILE` renders them again).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESTORE_TIMEOUT_S = 300.0  # a restore that has not finished by then is reported as such
JOB = os.path.join(HERE, "_pbt_job.py")
sys.path.insert(0, HERE)
from _pbt_job import CONCURRENT, INTERVAL, ITERATIONS, TRIALS  # noqa: E402

PAUSES = (ITERATIONS - 1) // INTERVAL  # perturbation points a trial passes before its end


def _env(mode: str) -> dict[str, str]:
    return {**os.environ, "PBT_SYNCH": "1" if mode == "synch" else "0"}


def _executed(work: str) -> list[str]:
    try:
        with open(os.path.join(work, "executed.log")) as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


def _stop_ray(framework: str) -> None:
    if framework.startswith("ray"):
        subprocess.run([os.path.join(os.path.dirname(sys.executable), "ray"), "stop", "--force"],
                       capture_output=True, check=False)


def _result(out: str) -> list:
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def run_once(framework: str, kind: str, mode: str, root: str, name: str) -> dict:
    """One uninterrupted sweep; its wall time, what it ran, and its result."""
    work = os.path.join(root, name + "-work")
    os.makedirs(work)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, JOB, framework, kind, root, name, work], env=_env(mode),
                          capture_output=True, text=True, check=False)
    wall = time.monotonic() - t0
    _stop_ray(framework)
    if proc.returncode != 0:
        raise RuntimeError(f"{framework} {kind} failed:\n{proc.stderr[-3000:]}")
    lines = _executed(work)
    return {"wall": wall, "executed": len(lines), "compute": sum(float(line.split()[2]) for line in lines),
            "result": _result(proc.stdout), "exploits": exploits(framework, os.path.join(root, name))}


def run_killed(framework: str, mode: str, root: str, name: str, kill_after: int) -> dict:
    """The PBT sweep, SIGKILLed (its whole process group) once `kill_after` iterations ran,
    then restored to the end."""
    work = os.path.join(root, name + "-work")
    os.makedirs(work)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, JOB, framework, "pbt", root, name, work], env=_env(mode),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    while len(_executed(work)) < kill_after and proc.poll() is None:
        time.sleep(0.05)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    _stop_ray(framework)
    try:
        restored = subprocess.run([sys.executable, JOB, framework, "pbt", root, name, work, "restore"],
                                  env=_env(mode), capture_output=True, text=True, check=False,
                                  timeout=RESTORE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _stop_ray(framework)
        return {"wall": None, "executed": len(_executed(work)), "result": None,
                "failed": f"restore did not finish in {RESTORE_TIMEOUT_S:g} s"}
    wall = time.monotonic() - t0
    _stop_ray(framework)
    if restored.returncode != 0:
        return {"wall": None, "executed": len(_executed(work)), "result": None,
                "failed": "restore failed: " + (restored.stderr.strip().splitlines() or ["?"])[-1][:80]}
    return {"wall": wall, "executed": len(_executed(work)), "result": _result(restored.stdout)}


def exploits(framework: str, path: str) -> int:
    """How many exploits the sweep made: unbroken's lineage records, Ray's pbt_global.txt."""
    if framework.startswith("ray"):
        log = os.path.join(path, "pbt_global.txt")
        return sum(1 for _ in open(log)) if os.path.exists(log) else 0
    count = 0
    for trial in os.listdir(path):
        lineage = os.path.join(path, trial, ".unbroken", "pbt.json")
        if os.path.exists(lineage):
            count += sum(1 for d in json.load(open(lineage)) if d.get("donor"))
    return count


def measure(framework: str, modes: list[str], repeats: int, kill_at: float) -> dict:
    out: dict = {"fifo": [], **{m: [] for m in modes}, **{m + "-killed": [] for m in modes}}
    for r in range(repeats):
        with tempfile.TemporaryDirectory() as root:
            out["fifo"].append(run_once(framework, "fifo", "synch", root, f"fifo{r}"))
            for mode in modes:
                clean = run_once(framework, "pbt", mode, root, f"{mode}{r}")
                out[mode].append(clean)
                at = int(kill_at * clean["executed"])
                killed = run_killed(framework, mode, root, f"{mode}-killed{r}", at)
                killed["same"] = killed["result"] == clean["result"]
                out[mode + "-killed"].append(killed)
        print(f"{framework}: repeat {r + 1} of {repeats} done: {json.dumps(out, default=str)}",
              file=sys.stderr, flush=True)
    return out


def render(results: dict[str, dict], modes: list[str], args: argparse.Namespace) -> str:
    frameworks = list(results)
    med = statistics.median

    def cell(fw: str, fn) -> str:
        try:
            return fn(results[fw])
        except (KeyError, ZeroDivisionError, statistics.StatisticsError):
            return "-"

    rows = [("FIFO sweep: wall time", lambda r: f"{med(x['wall'] for x in r['fifo']):.1f} s"),
            ("FIFO sweep: overhead per trial",
             lambda r: f"{med((x['wall'] * CONCURRENT - x['compute']) / TRIALS for x in r['fifo']):.2f} s")]
    for mode in modes:
        rows += [
            (f"PBT {mode}: wall time", lambda r, m=mode: f"{med(x['wall'] for x in r[m]):.1f} s"),
            (f"PBT {mode}: exploits", lambda r, m=mode: f"{med(x['exploits'] for x in r[m]):g}"),
            (f"PBT {mode}: overhead per pause ((PBT - FIFO wall time) / {TRIALS * PAUSES} pauses)",
             lambda r, m=mode: "{:.2f} s".format(med((x['wall'] - f['wall']) / (TRIALS * PAUSES)
                                                     for x, f in zip(r[m], r['fifo'], strict=True)))),
            (f"PBT {mode}: overhead per exploit", lambda r, m=mode: "{:.2f} s".format(med(
                (x['wall'] - f['wall']) / x['exploits'] for x, f in zip(r[m], r['fifo'], strict=True)))),
            (f"PBT {mode}: iterations run (of {TRIALS * ITERATIONS})",
             lambda r, m=mode: f"{med(x['executed'] for x in r[m]):g}"),
            (f"PBT {mode}, killed at {args.kill_at:.0%} and restored: wall time",
             lambda r, m=mode: _killed(r[m + "-killed"], lambda xs: f"{med(x['wall'] for x in xs):.1f} s")),
            (f"PBT {mode}, killed and restored: iterations run (uninterrupted: the row above)",
             lambda r, m=mode: _killed(r[m + "-killed"],
                                       lambda xs: f"{med(x['executed'] for x in xs):g}")),
            (f"PBT {mode}, killed and restored: every trial's config and score as uninterrupted",
             lambda r, m=mode: ", ".join("-" if x.get("failed") else "yes" if x["same"] else "no"
                                         for x in r[m + "-killed"])),
        ]
    lines = ["| | " + " | ".join(frameworks) + " |", "|---" * (len(frameworks) + 1) + "|"]
    for label, fn in rows:
        lines.append(f"| {label} | " + " | ".join(cell(fw, fn) for fw in frameworks) + " |")
    return "\n".join(lines)


def _killed(runs: list[dict], fmt) -> str:
    """A killed-and-restored cell: the median of the runs that finished, else why none did."""
    done = [x for x in runs if not x.get("failed")]
    return fmt(done) if done else runs[0]["failed"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frameworks", default="unbroken,unbroken-reuse,ray,ray-reuse")
    parser.add_argument("--modes", default="synch,async")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--kill-at", type=float, default=0.5)
    parser.add_argument("--from-log", help="render the raw figures a run wrote to stderr")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    results = {}
    if args.from_log:
        for line in open(args.from_log):
            if ": repeat " in line and " done: " in line:
                results[line.split(":", 1)[0]] = json.loads(line.split(" done: ", 1)[1])
        print(render(results, modes, args))
        return 0
    for fw in args.frameworks.split(","):
        if fw.startswith("ray"):
            try:
                import ray.tune  # noqa: F401
            except ImportError:
                print("Ray Tune is not installed: its column is left out", file=sys.stderr)
                continue
        results[fw] = measure(fw, modes, args.repeats, args.kill_at)
    print(render(results, modes, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
