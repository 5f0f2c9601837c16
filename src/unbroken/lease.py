"""One driver per run: a lease file with a heartbeat in the run directory.

A second driver is refused while the holder's heartbeat is fresh. A lease whose holder
is gone (its process is dead on this host, or its heartbeat is older than the TTL) is
taken over with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid

from unbroken.errors import LeaseHeldError
from unbroken.manifest import META_DIR
from unbroken.storage import Storage

log = logging.getLogger("unbroken")

LEASE_JSON = f"{META_DIR}/lease.json"


def _ttl() -> float:
    return float(os.environ.get("UNBROKEN_LEASE_TTL_S", "30"))


def _process_start(pid: int) -> str | None:
    """A token that changes when a pid is reused (Linux); None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
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
    """The lease this driver holds on one run directory."""

    HEARTBEAT_EVERY_S = 2.0

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.token = uuid.uuid4().hex
        self._last_beat = 0.0

    def _record(self) -> dict:
        pid = os.getpid()
        return {"token": self.token, "host": socket.gethostname(), "pid": pid,
                "process_start": _process_start(pid), "heartbeat": time.time(), "ttl_s": _ttl()}

    def current_holder(self) -> dict | None:
        try:
            return json.loads(self.storage.read_bytes(LEASE_JSON))
        except (FileNotFoundError, ValueError):
            return None

    def acquire(self) -> None:
        holder = self.current_holder()
        if holder and holder.get("token") != self.token:
            if _holder_alive(holder):
                raise LeaseHeldError(
                    f"run {self.storage.url()!r} is being driven by another process "
                    f"(pid {holder.get('pid')} on {holder.get('host')}, last heartbeat "
                    f"{time.time() - float(holder.get('heartbeat', 0)):.1f}s ago). Hint: wait for it "
                    "to finish or stop it; a lease whose driver died is taken over automatically")
            log.warning("taking over the lease on %s from pid %s on %s, which is no longer alive",
                        self.storage.url(), holder.get("pid"), holder.get("host"))
        self.beat(force=True)
        # Two drivers racing for a free lease: the one whose write landed last wins.
        holder = self.current_holder()
        if holder is None or holder.get("token") != self.token:
            raise LeaseHeldError(f"run {self.storage.url()!r} was claimed by another driver at the "
                                 "same moment. Hint: run one driver per run")

    def beat(self, force: bool = False) -> None:
        """Refresh the heartbeat; cheap to call often (writes at most every HEARTBEAT_EVERY_S)."""
        now = time.monotonic()
        if force or now - self._last_beat >= self.HEARTBEAT_EVERY_S:
            self.storage.write_atomic(LEASE_JSON, json.dumps(self._record()).encode())
            self._last_beat = now

    def release(self) -> None:
        holder = self.current_holder()
        if holder and holder.get("token") == self.token:
            self.storage.remove(LEASE_JSON)
