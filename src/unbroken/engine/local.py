"""The local engine: `num_workers` worker processes on this machine, one pipe each.

Workers are forked from the driver when that is safe, so they start with everything
the driver imported (torch included) in milliseconds. Forking is unsafe once the
driver has started threads (an OpenMP pool left by a torch op hangs a forked child),
so then workers come from a forkserver that preloads torch once per driver process.
A dead worker is noticed at once: its process sentinel is in the same wait as the pipes.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import selectors
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from unbroken.engine.worker import Pickled, WorkerPayload, worker_main

# Python threads that survive a fork harmlessly: fsspec's event-loop thread for async
# filesystems (s3fs, gcsfs) and that loop's executor threads (DNS lookups) are idle between
# requests, fsspec resets its loop in a forked child, and workers open their own instance.
_FORK_SAFE_THREADS = ("fsspecIO", "asyncio_")


def _thread_count() -> int:
    """OS threads of this process, not counting the known fork-safe ones."""
    safe = sum(1 for t in threading.enumerate() if t.name.startswith(_FORK_SAFE_THREADS))
    try:
        return len(os.listdir("/proc/self/task")) - safe
    except OSError:
        return threading.active_count() - safe


_clean_threads = _thread_count()


def mark_clean() -> None:
    """Record that the process is still fork-safe now (called right after `import torch`)."""
    global _clean_threads
    _clean_threads = max(_clean_threads, _thread_count())


def start_method() -> str:
    """'fork' while the driver has no threads beyond those it had when unbroken was imported."""
    chosen = os.environ.get("UNBROKEN_START_METHOD")
    if chosen:
        return chosen
    if sys.platform != "linux" or _thread_count() > _clean_threads:
        return "forkserver"
    return "fork"


def visible_gpus() -> tuple[int, str]:
    """(the number of CUDA GPUs workers started here would see, how that was found out).

    Never initialises CUDA in the driver (forked workers could not use it then): NVML
    counts the devices, honouring CUDA_VISIBLE_DEVICES, unless CUDA is already initialised."""
    try:
        import torch
    except ImportError:
        return 0, "torch is not installed"
    if not torch.backends.cuda.is_built():
        return 0, f"torch.cuda.device_count() is 0: torch {torch.__version__} is a CPU-only build"
    count = -1
    if not torch.cuda.is_initialized():
        count = getattr(torch.cuda, "_device_count_nvml", lambda: -1)()
    if count < 0:  # no NVML: without the NVIDIA driver, counting initialises nothing
        count = torch.cuda.device_count()
    return count, f"torch.cuda.device_count() is {count}"


def _context(method: str) -> Any:
    ctx = mp.get_context(method)
    if method == "forkserver":
        preload = ["torch"] if "torch" in sys.modules else []
        ctx.set_forkserver_preload([*preload, "unbroken.engine.forkserver_init", "unbroken.engine.worker"])
    return ctx


class WorkerDied(Exception):
    def __init__(self, rank: int, exitcode: int | None) -> None:
        if exitcode is not None and exitcode < 0:
            how = f"was killed by {signal.Signals(-exitcode).name}"
        else:
            how = f"exited with code {exitcode} without reporting an error"
        super().__init__(f"worker rank {rank} (of the local engine) {how}")
        self.rank = rank
        self.exitcode = exitcode


class LocalWorkerGroup:
    """Worker processes on this machine, addressed by rank."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self._selector = selectors.DefaultSelector()

    def start(self, make_payload: Callable[[int, int, int], WorkerPayload]) -> None:
        """Start every worker; `make_payload(rank, local_rank, node_rank)` says what it runs."""
        method = start_method()
        ctx = _context(method)
        # A forked worker's parent is this driver; a forkserver's child has the server as parent.
        parent = os.getpid() if method == "fork" else None
        for rank in range(self.num_workers):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=worker_main, name=f"unbroken-worker-{rank}",
                               args=(Pickled(make_payload(rank, rank, 0)), child_end, parent))
            proc.start()
            child_end.close()
            self.procs.append(proc)
            self.conns.append(parent_end)
            self._selector.register(parent_end, selectors.EVENT_READ, ("message", rank))
            self._selector.register(proc.sentinel, selectors.EVENT_READ, ("exit", rank))

    def watch(self, source: Any) -> None:
        """Also wake `poll` when `source` (anything with fileno() and drain()) becomes readable."""
        self._selector.register(source, selectors.EVENT_READ, ("wake", source))

    def send(self, rank: int, message: Any) -> None:
        try:
            self.conns[rank].send(message)
        except (BrokenPipeError, ConnectionResetError):
            pass  # its death is reported by poll()

    def poll(self, timeout: float) -> list[tuple[int, Any]]:
        """What happened within `timeout`, as (rank, message) in each rank's order.

        A worker that exited without saying it was done appears once as (rank, WorkerDied),
        in a poll after the one that returned its last message (its error report, or a report
        that completes a round), so the caller has seen that message first.
        """
        out, dead = [], []
        for key, _ in self._selector.select(timeout):
            kind, what = key.data
            if kind == "wake":
                what.drain()
            elif kind == "exit":
                dead.append(what)
            else:
                out.extend(self._read(what))
        for rank in dead:
            out.extend(self._read(rank))
            if any(r == rank for r, _ in out):
                continue  # its death shows in the next poll, unless a message said it was done
            self._selector.unregister(self.procs[rank].sentinel)
            self.procs[rank].join()
            out.append((rank, WorkerDied(rank, self.procs[rank].exitcode)))
        return out

    def _read(self, rank: int) -> list[tuple[int, Any]]:
        """Every message waiting in `rank`'s pipe."""
        conn, out = self.conns[rank], []
        try:
            while conn.poll():
                out.append((rank, conn.recv()))
        except (EOFError, OSError):
            if conn.fileno() in self._selector.get_map():
                self._selector.unregister(conn)
        return out

    def killed_by_signal(self, wait_s: float) -> list[WorkerDied]:
        """Workers that died by a signal, waiting up to `wait_s` for one to go. When a rank
        reports an error, a peer killed at the same moment (OOM, SIGKILL) is the root cause:
        the reporting rank's error is usually just the broken connection to it."""
        alive = [p for p in self.procs if p.exitcode is None]
        if alive:
            mp.connection.wait([p.sentinel for p in alive], timeout=wait_s)
        return [WorkerDied(rank, p.exitcode) for rank, p in enumerate(self.procs)
                if p.exitcode is not None and p.exitcode < 0]

    def mark_finished(self, rank: int) -> None:
        """A worker said it is done: its exit is expected from now on."""
        self._selector.unregister(self.procs[rank].sentinel)

    def shutdown(self, kill: bool = False) -> None:
        """Wait for the workers to exit (or SIGKILL them) and close the pipes."""
        for proc in self.procs:
            if kill and proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(5 if not kill else None)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self._selector.close()
        self.procs, self.conns = [], []
