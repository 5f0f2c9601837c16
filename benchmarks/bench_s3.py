"""Checkpoint upload throughput to a local S3-compatible server vs a plain s3fs put of the same files.

    python benchmarks/bench_s3.py [--files N] [--mb-per-file MB] [--repeats N] [--quick]

Starts the moto server (tools/s3_server.py, loopback, one Python process), creates a bucket,
and makes one checkpoint as two ranks would: each rank has a local directory of `--files`
files of `--mb-per-file` MiB of random bytes (default 4 x 16 MiB per rank). Then, per repeat,
in a rotating order:

(a) unbroken: two processes forked at once (one per rank), each calling
    `unbroken.store.commit.write_rank_files(Storage.from_url(run_url), staging, local_dir, rank)`
    as workers do inside train.report, then the driver's `CheckpointManager.commit` of the
    merged file lists, which uploads the marker. Timed from the moment both ranks start to the
    committed marker.
(b) plain s3fs, one process: `s3fs.S3FileSystem().put(local_files, remote_paths)` of both
    ranks' files.
(c) plain s3fs, two processes in parallel, one per rank, each putting its own files: the
    fairest comparison with (a).

Every upload runs in a process forked for it that creates its own filesystem instance
(fsspec instances are not fork-safe) and makes one untimed request first, so that every
path starts with a connected client, as a worker that has checkpointed before does. The
clock starts when all processes are past a barrier and stops in the parent. The uploaded
objects are checked (count and bytes) and deleted after each measurement, untimed. Prints a
markdown table of medians (min-max), the ratio unbroken / plain, and the S3 requests each
path made.

The server is a single Python process on the same cores as the clients, and is likely the
bottleneck: the numbers compare the client paths, they are not S3's throughput. The CPU seconds
the server and the uploading processes use during each upload are reported alongside.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
SERVER = os.path.join(HERE, "..", "tools", "s3_server.py")
BUCKET = "bench"
RANKS = 2
METHODS = ("unbroken", "plain-1", "plain-2")
LABELS = {
    "unbroken": "(a) unbroken: 2 ranks' write_rank_files + driver commit",
    "plain-1": "(b) plain s3fs put, 1 process",
    "plain-2": "(c) plain s3fs put, 2 processes (1 per rank)",
}

# S3 requests made by this process since the last reset, by operation (filled by the patch below).
REQUESTS: Counter = Counter()
SERVER_PID: int | None = None


def server_cpu_s() -> float | None:
    """CPU seconds the S3 server process has used so far (Linux), or None."""
    try:
        with open(f"/proc/{SERVER_PID}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, TypeError):
        return None


def count_requests() -> None:
    """Count every S3 call s3fs makes in this process (and in processes forked from it)."""
    import s3fs

    original = s3fs.S3FileSystem._call_s3

    async def counted(self, method, *args, **kwargs):
        REQUESTS[method] += 1
        return await original(self, method, *args, **kwargs)

    s3fs.S3FileSystem._call_s3 = counted


# -- the server -------------------------------------------------------------------------------------
def start_server() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    line = proc.stdout.readline()
    if not line.startswith("S3 "):
        proc.kill()
        raise RuntimeError(f"the S3 server did not start: {line!r}")
    return proc, f"http://127.0.0.1:{line.split()[1]}"


def s3_client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint)


def stored(client, prefix: str) -> tuple[int, int]:
    """(objects, bytes) under `prefix` in the bucket."""
    n = size = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        for obj in page.get("Contents", []):
            n += 1
            size += obj["Size"]
    return n, size


def delete(client, prefix: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})


# -- the measured work, each in a forked process ---------------------------------------------------
def make_files(root: str, files: int, mb: int) -> list[list[str]]:
    """Each rank's local checkpoint directory: `files` files of `mb` MiB of random bytes."""
    per_rank = []
    for rank in range(RANKS):
        directory = os.path.join(root, f"rank{rank}")
        os.makedirs(directory)
        paths = []
        for k in range(files):
            path = os.path.join(directory, f"shard{rank}_{k}.bin")
            with open(path, "wb") as f:
                for _ in range(mb):
                    f.write(os.urandom(1 << 20))
            paths.append(path)
        per_rank.append(paths)
    return per_rank


def unbroken_rank(run_url: str, staging: str, local_dir: str, rank: int, barrier, conn) -> None:
    from unbroken.store.commit import write_rank_files
    from unbroken.store.storage import Storage

    storage = Storage.from_url(run_url)
    storage.exists()  # connect (untimed)
    REQUESTS.clear()
    barrier.wait()
    cpu0 = cpu_s()
    entries = write_rank_files(storage, staging, local_dir, rank)
    conn.send((entries, dict(REQUESTS), cpu_s() - cpu0))


def plain_put(sources: list[str], targets: list[str], barrier, conn) -> None:
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.exists(BUCKET)  # connect (untimed)
    REQUESTS.clear()
    barrier.wait()
    cpu0 = cpu_s()
    fs.put(sources, targets)
    conn.send((None, dict(REQUESTS), cpu_s() - cpu0))


def cpu_s() -> float:
    """CPU seconds this process (all its threads) has used so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_forked(jobs: list[tuple], after=None) -> tuple[float, float, tuple, Counter]:
    """Fork one process per (target, args) job; start them together; return (seconds until every
    job is done, seconds spent in `after(results)` in this process, (the server's CPU seconds
    meanwhile, the clients' CPU seconds while uploading), requests)."""
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(len(jobs) + 1)
    procs, conns = [], []
    for target, args in jobs:
        parent_end, child_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=target, args=(*args, barrier, child_end), daemon=True)
        proc.start()
        child_end.close()
        procs.append(proc)
        conns.append(parent_end)
    barrier.wait(timeout=120)
    start = time.perf_counter()
    cpu0 = server_cpu_s()
    results, requests, clients_s = [], Counter(), 0.0
    for conn in conns:
        try:
            result, counts, cpu = conn.recv()
        except EOFError:
            raise RuntimeError("an upload process died; see its traceback above") from None
        results.append(result)
        requests.update(counts)
        clients_s += cpu
    uploaded = time.perf_counter() - start
    tail = 0.0
    if after is not None:
        REQUESTS.clear()
        t, cpu = time.perf_counter(), cpu_s()
        after(results)
        tail = time.perf_counter() - t
        clients_s += cpu_s() - cpu  # the driver's commit is client work too
        requests.update(REQUESTS)
    cpu1 = server_cpu_s()
    server_s = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
    for proc in procs:
        proc.join(timeout=60)
    return uploaded + tail, tail, (server_s, clients_s), requests


def measure(method: str, repeat: int, local: list[list[str]], manager, run_prefix: str) -> tuple:
    """One timed upload of the whole checkpoint: (seconds, of which commit seconds, (server, client)
    CPU seconds, requests, prefix to check and delete)."""
    if method == "unbroken":
        from unbroken.store.commit import staging_name

        iteration = repeat + 1
        staging = staging_name(iteration, 1, manager.storage)
        jobs = [(unbroken_rank, (manager.storage.url(), staging, os.path.dirname(local[r][0]), r))
                for r in range(RANKS)]
        seconds, tail, cpu, requests = run_forked(
            jobs, lambda per_rank: manager.commit(iteration, 1, per_rank, {"repeat": repeat}))
        return seconds, tail, cpu, requests, f"{run_prefix}/{staging}"
    prefix = f"{method}/{repeat}"

    def targets(paths: list[str]) -> list[str]:
        return [f"{BUCKET}/{prefix}/{os.path.basename(p)}" for p in paths]

    if method == "plain-1":
        every = [p for paths in local for p in paths]
        jobs = [(plain_put, (every, targets(every)))]
    else:
        jobs = [(plain_put, (paths, targets(paths))) for paths in local]
    seconds, _, cpu, requests = run_forked(jobs)
    return seconds, 0.0, cpu, requests, prefix


# -- reporting -------------------------------------------------------------------------------------
def fmt(values: list[float], digits: int = 2) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def crc_seconds(local: list[list[str]]) -> float:
    """Time to CRC32 one rank's files from the page cache, as unbroken does before uploading."""
    start = time.perf_counter()
    for path in local[0]:
        with open(path, "rb") as f:
            crc = 0
            while chunk := f.read(8 << 20):
                crc = zlib.crc32(chunk, crc)
    return time.perf_counter() - start


def render(times: dict, commits: list[float], busy: dict, clients: dict, requests: dict, total_mb: float,
           args, crc_s: float) -> str:
    mbps = {m: [total_mb / s for s in times[m]] for m in METHODS}
    lines = [
        f"## Checkpoint upload to S3 (moto on loopback) — {args.repeats} repeats, {RANKS} ranks x "
        f"{args.files} files x {args.mb_per_file} MiB = {total_mb:g} MiB, {os.cpu_count()} CPUs, "
        f"Python {sys.version.split()[0]}",
        "",
        "Medians, (min–max) over the repeats.",
        "",
        "| Path | MiB/s | seconds | unbroken's MiB/s ÷ this row's (paired median) | server CPU "
        "| client CPU | S3 requests |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in METHODS:
        ratio = statistics.median(times[m]) / statistics.median(times["unbroken"])
        paired = statistics.median(b / a for a, b in zip(times["unbroken"], times[m], strict=True))
        reqs = ", ".join(f"{n} {op}" for op, n in sorted(requests[m].items()))
        server = f"{statistics.median(busy[m]):.2f} s" if busy[m] else "n/a"
        lines.append(f"| {LABELS[m]} | {fmt(mbps[m], 0)} | {fmt(times[m])} | {ratio:.2f} × ({paired:.2f} ×) "
                     f"| {server} | {statistics.median(clients[m]):.2f} s | {reqs} |")
    lines += [
        "",
        f"Of (a): the driver's commit (marker upload) took {fmt(commits, 3)} s; computing the CRC32 of one "
        f"rank's {args.files * args.mb_per_file} MiB, which each rank does before its upload, takes "
        f"{crc_s:.3f} s here.",
        "Server / client CPU: CPU seconds used by the S3 server process and by the uploading "
        "processes (and the driver's commit) during one upload, medians. The server is one Python "
        "process (its request threads share one interpreter lock) on the same cores as the clients, "
        "so the MiB/s describe this setup, not S3: compare the rows.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=None, help="files per rank (default 4, --quick 2)")
    parser.add_argument("--mb-per-file", type=int, default=None, help="MiB per file (default 16, --quick 8)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs of each measurement; the table shows medians (default 5, --quick 3)")
    parser.add_argument("--quick", action="store_true", help="3 repeats of a smaller checkpoint")
    args = parser.parse_args(argv)
    args.files = args.files or (2 if args.quick else 4)
    args.mb_per_file = args.mb_per_file or (8 if args.quick else 16)
    args.repeats = args.repeats or (3 if args.quick else 5)
    total_mb = RANKS * args.files * args.mb_per_file

    global SERVER_PID
    server, endpoint = start_server()
    SERVER_PID = server.pid
    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint})
    try:
        count_requests()
        from unbroken.core.config import CheckpointConfig
        from unbroken.store.checkpoint_manager import CheckpointManager
        from unbroken.store.storage import Storage

        client = s3_client(endpoint)
        client.create_bucket(Bucket=BUCKET)
        run_prefix = "runs/bench-run"
        # The driver opens the run's storage once, as unbroken's driver does.
        manager = CheckpointManager(Storage.from_url(f"s3://{BUCKET}/{run_prefix}"), CheckpointConfig())
        manager.storage.exists()
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        requests: dict[str, Counter] = {}
        busy: dict[str, list[float]] = {m: [] for m in METHODS}
        clients: dict[str, list[float]] = {m: [] for m in METHODS}
        commits: list[float] = []
        with tempfile.TemporaryDirectory(prefix="unbroken-bench-s3-") as root:
            local = make_files(root, args.files, args.mb_per_file)
            crc_s = crc_seconds(local)
            began = time.perf_counter()
            for i in range(args.repeats):
                order = list(METHODS[i % len(METHODS):] + METHODS[:i % len(METHODS)])  # no fixed first
                for m in order:
                    seconds, commit_s, (server_s, client_s), reqs, prefix = measure(m, i, local, manager,
                                                                                    run_prefix)
                    n, size = stored(client, prefix)
                    expected = RANKS * args.files + (1 if m == "unbroken" else 0)
                    if n != expected or size < total_mb * (1 << 20):
                        raise RuntimeError(f"{m}: found {n} objects, {size} bytes under {prefix}")
                    delete(client, prefix)
                    times[m].append(seconds)
                    requests[m] = reqs
                    if server_s is not None:
                        busy[m].append(server_s)
                    clients[m].append(client_s)
                    if m == "unbroken":
                        commits.append(commit_s)
                print(f"[bench] repeat {i + 1}/{args.repeats} done ({time.perf_counter() - began:.0f} s)",
                      file=sys.stderr, flush=True)
    finally:
        server.stdin.close()
        server.wait(timeout=30)
    print(render(times, commits, busy, clients, requests, total_mb, args, crc_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
