"""The local engine: `num_workers` worker processes on this machine, one pipe each.

Workers are forked from the driver when that is safe, so they start with everything
the driver imported (torch included) in milliseconds. Forking is unsafe once the
driver has started threads (an OpenMP pool left by a torch op hangs a forked child),
so then workers come from a forkserver that preloads torch once per driver process.
A dead worker is noticed at once: its process sentinel is in the same wait as the pipes.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.forkserver
import os
import select
import selectors
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

import cloudpickle

from unbroken.core import faults
from unbroken.core.processes import Carried, die_with_parent, ignore_terminal_signals
from unbroken.errors import WorkerDied
from unbroken.execution.engine import kept_group
from unbroken.execution.engine.base import Event, Placement, Wakeup
from unbroken.worker import preemption, process_reuse, stacks
from unbroken.worker.channel import PipeChannel
from unbroken.worker.protocol import Done, from_wire, to_wire
from unbroken.worker.recovery.messages import Rejoin
from unbroken.worker.runner import WorkerPayload, next_run, serve

# Python threads that survive a fork harmlessly: fsspec's event-loop thread for async
# filesystems (s3fs, gcsfs) and that loop's executor threads (DNS lookups) are idle between
# requests, fsspec resets its loop in a forked child, and workers open their own instance.
# The threads of callbacks that run in the background (run/hook_thread.py) run no torch.
_FORK_SAFE_THREADS = ("fsspecIO", "asyncio_", "unbroken-hooks")


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
    """'fork' while the driver has no threads beyond those it had when unbroken was imported,
    and has not initialised CUDA (a forked child cannot use CUDA then)."""
    chosen = os.environ.get("UNBROKEN_START_METHOD")
    if chosen:
        return chosen
    if sys.platform != "linux" or _thread_count() > _clean_threads or _cuda_initialized():
        return "forkserver"
    return "fork"


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


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


def _context(method: str, num_workers: int) -> Any:
    ctx = mp.get_context(method)
    if method == "forkserver":
        preload = ["torch"] if "torch" in sys.modules else []
        if preload and num_workers > 1:
            preload.append("torch._dynamo")  # DDP imports it on first use: 1+ s in each worker
        ctx.set_forkserver_preload([*preload, "unbroken.execution.engine.forkserver_init",
                                   "unbroken.execution.engine.local"])
    return ctx


def warm_up(num_workers: int) -> None:
    """Get restarts ready: start the forkserver now, in the background, with torch (and
    torch._dynamo, which DDP imports on a worker's first use) imported once, so that the
    workers of a later attempt fork from it and are in the training loop at once instead of
    importing them again. Costs a process with torch imported (its import time, in the
    background, and its memory) and nothing on the running attempt's reports; the driver's
    own imports and exit are untouched. A restart that comes before the forkserver is warm
    waits for it, which takes about as long as importing in each new worker would."""
    if os.environ.get("UNBROKEN_START_METHOD"):
        return
    _context("forkserver", num_workers)
    mp.forkserver.ensure_running()


def _died(rank: int, exitcode: int | None) -> WorkerDied:
    if exitcode is not None and exitcode < 0:
        return WorkerDied(rank, exit_code=exitcode, signal_name=signal.Signals(-exitcode).name)
    return WorkerDied(rank, exit_code=exitcode)


def worker_process(payload: Carried, conn: Any, parent_pid: int | None, kept: bool = False,
                   drivers_end: Any = None) -> None:
    """A local worker process: the process-level part around the engine-neutral `serve`.
    It ignores terminal signals (the driver coordinates), dies with its parent, and exits
    without running the driver's atexit handlers it inherited through fork. `kept`: after a
    run that ends cleanly it waits for the next one (`kept_group`). `drivers_end`: the
    driver's end of the pipe, inherited through fork and closed here at once, so that the
    driver's closing it is seen here."""
    if drivers_end is not None:
        drivers_end.close()
    ignore_terminal_signals()
    preemption.arm(notify_on_sigterm=True)  # a SIGTERM to this process is a notice for the driver
    die_with_parent(parent_pid)
    # A child of the forkserver inherits "forkserver" as its start method. The loop's own
    # processes (DataLoader workers) must start as in a plain process: a forkserver of theirs
    # outlives a SIGKILLed rank, and keeps its children alive with it.
    mp.set_start_method(None, force=True)
    stacks.arm()
    channel = PipeChannel(conn)
    if kept:
        process_reuse.mark_kept()
    outcome = serve(payload.obj, channel)
    while kept and isinstance(outcome, Done):
        faults.point("kept_worker_waits")  # crash tests: a kept rank dies waiting for the next run
        following = next_run(channel)
        if following is None:
            break
        outcome = serve(following, channel)
    process_reuse.release_all()
    stacks.forget(os.getpid())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if isinstance(outcome, Done) else 1)


class LocalWorkerGroup:
    """Worker processes on this machine, addressed by rank: a `WorkerGroup` (engine.base)."""

    spans_machines = False

    def __init__(self, num_workers: int, cpus: int = 1, warm: bool = False) -> None:
        self.num_workers = num_workers
        self.cpus = cpus
        self.warm = warm  # the previous attempt warmed the forkserver up: start the workers from it
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self._selector = selectors.DefaultSelector()
        self._wake: Wakeup | None = None
        self._pending: dict[int, select.poll] = {}  # by pipe fd: whether a message waits in it

    def start(self, payload: Callable[[Placement], WorkerPayload]) -> list[Placement]:
        if self.procs:  # kept from the run before (`kept_group`): each rank takes this run
            self._watch_all()
            return self.rejoin(payload, set())
        host = socket.gethostname()
        n = self.num_workers
        self.placements = [Placement(rank=r, node_rank=0, local_rank=r, local_world_size=n, node_id=host,
                                     node_address="127.0.0.1", cpus=self.cpus) for r in range(n)]
        self.procs, self.conns = [None] * n, [None] * n
        for p in self.placements:
            self._spawn(p, payload(p))
        return self.placements

    def _spawn(self, placement: Placement, payload: WorkerPayload) -> None:
        """Start the process of rank `placement.rank`: from the warm forkserver when there is one."""
        warm = self.warm and not os.environ.get("UNBROKEN_START_METHOD")
        method = "forkserver" if warm else start_method()
        ctx = _context(method, self.num_workers)
        # A forked worker's parent is this driver; a forkserver's child has the server as parent.
        parent = os.getpid() if method == "fork" else None
        parent_end, child_end = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=worker_process, name=f"unbroken-worker-{placement.rank}",
                           args=(Carried(payload, ignore_terminal_signals), child_end, parent,
                                 kept_group.keeping(), parent_end if method == "fork" else None))
        proc.start()
        child_end.close()
        self.procs[placement.rank], self.conns[placement.rank] = proc, parent_end
        self._selector.register(parent_end, selectors.EVENT_READ, ("message", placement.rank))
        self._selector.register(proc.sentinel, selectors.EVENT_READ, ("exit", placement.rank))

    can_rejoin = True

    def rejoin(self, payload: Callable[[Placement], WorkerPayload], replaced: set[int]) -> list[Placement]:
        """The next attempt on the processes that stayed, and new ones for `replaced`."""
        for rank in sorted(replaced):
            self._drop(rank)
            self._spawn(self.placements[rank], payload(self.placements[rank]))
        for rank in range(self.num_workers):
            if rank not in replaced:
                self.send(rank, Rejoin(cloudpickle.dumps(payload(self.placements[rank]))))
        return self.placements

    def idle_slots(self) -> int:
        return 0  # this machine's processes reserve nothing

    def kill(self, rank: int) -> None:
        if self.procs[rank].is_alive():
            self.procs[rank].kill()

    def interrupt(self, ranks: set[int]) -> None:
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError):
                if self.procs[rank].is_alive():
                    os.kill(self.procs[rank].pid, preemption.ABANDON_SIGNAL)

    def _drop(self, rank: int) -> None:
        """Kill rank `rank`'s process if it still runs, and forget it."""
        proc, conn = self.procs[rank], self.conns[rank]
        for watched in (proc.sentinel, conn):
            try:
                self._selector.unregister(watched)
            except (KeyError, ValueError):
                pass  # its death or its closed pipe was seen already
        if proc.is_alive():
            proc.kill()
        proc.join()
        conn.close()

    def send(self, rank: int, message: Any) -> None:
        try:
            self.conns[rank].send(to_wire(message))
        except (BrokenPipeError, ConnectionResetError):
            pass  # its death is reported by poll()

    def poll(self, timeout: float, wake: Wakeup | None = None) -> list[Event]:
        if wake is not None and wake is not self._wake:
            self._selector.register(wake, selectors.EVENT_READ, ("wake", wake))
            self._wake = wake
        out: list[Event] = []
        dead = []
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
            out.append((rank, _died(rank, self.procs[rank].exitcode)))
        return out

    def _read(self, rank: int) -> list[Event]:
        """Every message waiting in `rank`'s pipe."""
        conn, out = self.conns[rank], []
        try:
            waiting = self._pending.get(conn.fileno())
            if waiting is None:  # one poll object per pipe: Connection.poll() builds a selector each time
                waiting = self._pending[conn.fileno()] = select.poll()
                waiting.register(conn.fileno(), select.POLLIN)
            while waiting.poll(0):
                out.append((rank, from_wire(conn.recv())))
        except (EOFError, OSError):
            if conn.fileno() in self._selector.get_map():
                self._selector.unregister(conn)
        return out

    def lost_ranks(self, wait_s: float) -> list[WorkerDied]:
        alive = [p for p in self.procs if p.exitcode is None]
        if alive:
            mp.connection.wait([p.sentinel for p in alive], timeout=wait_s)
        return [_died(rank, p.exitcode) for rank, p in enumerate(self.procs)
                if p.exitcode is not None and p.exitcode < 0]

    def mark_finished(self, rank: int) -> None:
        self._selector.unregister(self.procs[rank].sentinel)

    def stacks(self, wait_s: float) -> dict[int, str | None]:
        return {rank: stacks.dump(proc.pid, wait_s) if proc.is_alive() else None
                for rank, proc in enumerate(self.procs)}

    def warm_up(self) -> None:
        warm_up(self.num_workers)
        self.warm = True  # a rank started again in place (`rejoin`) forks from it

    def release_placement(self) -> None:
        pass  # this machine's processes reserve nothing; the warm forkserver stays

    def shutdown(self, kill: bool = False, keep_warm: bool = False) -> None:
        if not kill and kept_group.park(self):
            return  # its ranks wait for the next run of this process
        self.close(kill)

    def close(self, kill: bool = False) -> None:
        """End the ranks' processes (killed with `kill`): their links are closed first, so a
        rank waiting for another run (`kept_group`) exits at once."""
        for conn in self.conns:
            conn.close()
        for proc in self.procs:
            if kill and proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(5 if not kill else None)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for proc in self.procs:
            stacks.forget(proc.pid)  # a killed rank could not remove its own
        self._selector.close()
        self.procs, self.conns = [], []

    def all_alive(self) -> bool:
        return bool(self.procs) and all(proc.is_alive() for proc in self.procs)

    def _watch_all(self) -> None:
        """Watch every rank's pipe and death again (a kept group's were let go as its run ended)."""
        self._selector.close()
        self._selector, self._wake = selectors.DefaultSelector(), None
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True)):
            self._selector.register(conn, selectors.EVENT_READ, ("message", rank))
            self._selector.register(proc.sentinel, selectors.EVENT_READ, ("exit", rank))
