"""One driver per run: a lease file with a heartbeat in the run directory.

A second driver is refused while the holder's heartbeat is fresh. A lease whose holder
is gone (its process is dead on this host, or its heartbeat is older than the TTL) is
taken over with a warning.

How a race between two drivers is decided: on object stores by conditional writes (create
if absent, replace if unchanged); on local disk and NFS by an advisory lock (`flock` on
`.unbroken/lease.lock`) held while a driver reads the lease, decides and writes it. The
kernel drops that lock when its process dies, so a kill never leaves it held.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator

from unbroken.errors import LeaseHeldError, LeaseLostError, StorageError
from unbroken.store.manifest import META_DIR
from unbroken.store.storage import CREATE, Storage
from unbroken.store.storage_errors import PreconditionFailed

log = logging.getLogger("unbroken")

LEASE_JSON = f"{META_DIR}/lease.json"
LEASE_LOCK = f"{META_DIR}/lease.lock"
LOCK_WAIT_S = 30.0  # the lock is held for one read and one write; longer means a stopped process


def _ttl() -> float:
    return float(os.environ.get("UNBROKEN_LEASE_TTL_S", "30"))


def _process_start(pid: int) -> str | None:
    """A token that changes when a pid is reused (Linux); None where it cannot be read, or
    where the process has exited and only its zombie is left (e.g. a sweep's trial driver
    killed with its sweep driver, whose zombie waits for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else fields[19]
    except (OSError, IndexError):
        return None


def _holder_alive(holder: dict) -> bool:
    """Same host: is the holder's process still running? Elsewhere: is its heartbeat fresh?"""
    if holder.get("host") == socket.gethostname() and os.path.isdir("/proc"):
        pid = holder.get("pid")
        start = _process_start(pid) if isinstance(pid, int) else None
        return start is not None and start == holder.get("process_start")
    return time.time() - float(holder.get("heartbeat", 0)) < float(holder.get("ttl_s", _ttl()))


class Lease:
    """The lease this driver holds on one run directory.

    Of two drivers racing for a run exactly one wins (see the module docstring), whether the
    lease is free or its holder is dead; a driver whose lease was taken over (its heartbeat
    stalled past the TTL) finds out at its next heartbeat and stops.
    """

    HEARTBEAT_EVERY_S = 2.0

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.token = uuid.uuid4().hex
        self._last_beat = 0.0
        self._version: str | None = None  # the object version our last write produced

    def _record(self) -> dict:
        pid = os.getpid()
        return {"token": self.token, "host": socket.gethostname(), "pid": pid,
                "process_start": _process_start(pid), "heartbeat": time.time(), "ttl_s": _ttl()}

    def current_holder(self) -> dict | None:
        return self._read()[0]

    def _read(self) -> tuple[dict | None, str | None]:
        """(holder record, what a write of the lease must expect: CREATE when there is no lease
        file, else its version, None where there are none); an unreadable record counts as no
        holder."""
        try:
            data, version = self.storage.read_versioned(LEASE_JSON)
        except FileNotFoundError:
            return None, CREATE
        try:
            holder = json.loads(data)
        except ValueError:
            return None, version
        return (holder if isinstance(holder, dict) else None), version

    @contextlib.contextmanager
    def _deciding(self) -> Iterator[None]:
        """Hold the lease lock while reading, deciding and writing (local disk and NFS);
        object stores decide by conditional writes and need none."""
        path = self.storage.local_path(LEASE_LOCK)
        if path is None:
            yield
            return
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # no run directory (any more): nothing to decide over
            yield
            return
        except OSError as e:
            raise StorageError(f"cannot open {LEASE_LOCK} in {self.storage.url()!r}: {e}. Hint: choose "
                               "a storage_path you can write to") from None
        try:
            deadline = time.monotonic() + LOCK_WAIT_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise LeaseHeldError(
                            f"run {self.storage.url()!r}: another process has held {LEASE_LOCK} for "
                            f"{LOCK_WAIT_S:g} s while deciding who drives the run; it may be stopped "
                            "(SIGSTOP) or hung. Hint: find and end it, then try again") from None
                    time.sleep(0.01)
            yield
        finally:
            os.close(fd)

    def acquire(self) -> None:
        with self._deciding():
            holder, version = self._read()
            if holder and holder.get("token") != self.token:
                if _holder_alive(holder):
                    raise self._held_by(holder)
                log.warning("taking over the lease on %s from pid %s on %s, which is no longer alive",
                            self.storage.url(), holder.get("pid"), holder.get("host"))
            try:
                self._write(version)
            except PreconditionFailed:
                raise self._raced() from None
        holder = self.current_holder()  # where writes are unconditional and unlocked: read back
        if holder is None or holder.get("token") != self.token:
            raise self._raced()

    def _held_by(self, holder: dict) -> LeaseHeldError:
        return LeaseHeldError(
            f"run {self.storage.url()!r} is being driven by another process "
            f"(pid {holder.get('pid')} on {holder.get('host')}, last heartbeat "
            f"{time.time() - float(holder.get('heartbeat', 0)):.1f}s ago). Hint: wait for it "
            "to finish or stop it; a lease whose driver died is taken over automatically")

    def _raced(self) -> LeaseHeldError:
        holder = self.current_holder()
        if holder is not None and holder.get("token") != self.token:
            return self._held_by(holder)
        return LeaseHeldError(f"run {self.storage.url()!r} was claimed by another driver at the "
                              "same moment. Hint: run one driver per run")

    def _write(self, expect: str | None) -> None:
        self._version = self.storage.write_conditional(LEASE_JSON, json.dumps(self._record()).encode(),
                                                       expect)
        self._last_beat = time.monotonic()

    def beat(self, force: bool = False) -> None:
        """Refresh the heartbeat; cheap to call often (writes at most every HEARTBEAT_EVERY_S).

        Raises LeaseLostError when another driver took the run over meanwhile."""
        if force or time.monotonic() - self._last_beat >= self.HEARTBEAT_EVERY_S:
            try:
                with self._deciding():
                    if self._version is None:  # no conditional writes here: look before writing
                        holder = self.current_holder()
                        if holder is not None and holder.get("token") != self.token:
                            raise PreconditionFailed("the lease holds another driver's token")
                    self._write(self._version)
            except PreconditionFailed:
                holder = self.current_holder() or {}
                raise LeaseLostError(
                    f"run {self.storage.url()!r} was taken over by another driver (pid "
                    f"{holder.get('pid')} on {holder.get('host')}) because this driver's heartbeat "
                    f"was older than {_ttl():g} s; this driver stops writing to it. Hint: keep one "
                    "driver per run, and raise UNBROKEN_LEASE_TTL_S if heartbeats can stall that "
                    "long") from None

    def release(self) -> None:
        with self._deciding():
            holder = self.current_holder()
            if holder and holder.get("token") == self.token:
                self.storage.remove(LEASE_JSON)


def live_holder(storage: Storage) -> dict | None:
    """The lease record of the driver that holds the run now, or None if no live driver does.
    Only reads."""
    try:
        holder = json.loads(storage.read_bytes(LEASE_JSON))
    except (FileNotFoundError, ValueError):
        return None
    return holder if isinstance(holder, dict) and _holder_alive(holder) else None
