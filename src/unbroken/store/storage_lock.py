"""A short critical section shared by processes on any machine that reach the same storage.

For a read-decide-write step that several processes run against the same files (ASHA's
judgement of a trial at a rung, made by each trial's own driver): whoever holds the lock sees
every record written by those who held it before.

- Local filesystems: an exclusive `flock` on the lock file (released by the kernel if the
  holder dies).
- Object stores with conditional writes (S3 and compatible servers): the lock is an object,
  created only if absent. A holder that died leaves it behind, so a lock older than
  `STALE_S` (far longer than the section it guards) is taken over, by a conditional write
  against the version that was read: of two processes taking over at once, one wins.
  Waiters poll with a growing back-off.
- Other object stores cannot lock: the section runs unguarded, as it did before, and a
  warning says so once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import time
import uuid
from collections.abc import Iterator

from unbroken.store.storage import CREATE, Storage
from unbroken.store.storage_errors import PreconditionFailed

log = logging.getLogger("unbroken")

STALE_S = 60.0  # a holder this long is taken to be dead
_warned: set[str] = set()


@contextlib.contextmanager
def held(storage: Storage, rel: str) -> Iterator[None]:
    """Hold the lock `rel` of `storage` for the body of the `with` (see the module docstring)."""
    if storage.is_local:
        import fcntl

        storage.makedirs(os.path.dirname(rel))
        with open(storage.path(rel), "a") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return
    if not storage.conditional_writes:
        if storage.url() not in _warned:
            _warned.add(storage.url())
            log.warning("storage %s has no conditional writes: %s is not locked", storage.url(), rel)
        yield
        return
    token = _acquire(storage, rel)
    try:
        yield
    finally:
        _release(storage, rel, token)


def _acquire(storage: Storage, rel: str) -> str:
    token = uuid.uuid4().hex
    wait = 0.01
    while True:
        mine = json.dumps({"token": token, "at": time.time(), "pid": os.getpid()}).encode()
        try:
            storage.write_conditional(rel, mine, CREATE)
            return token
        except PreconditionFailed:
            pass
        try:
            data, version = storage.read_versioned(rel)
            age = time.time() - float(json.loads(data)["at"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            continue  # released (or half-visible) meanwhile: try again at once
        if age > STALE_S and version is not None:
            try:
                storage.write_conditional(rel, mine, version)
                log.warning("took over the lock %s of %s, held %.0f s (its holder died?)", rel,
                            storage.url(), age)
                return token
            except PreconditionFailed:
                continue
        time.sleep(wait * (1 + random.random()))
        wait = min(wait * 2, 0.5)


def _release(storage: Storage, rel: str, token: str) -> None:
    with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
        if json.loads(storage.read_bytes(rel))["token"] == token:  # not taken over meanwhile
            storage.remove(rel)
