"""What a failed storage operation means, and retrying the failures worth retrying.

A call to an object store can fail with a fault of the network or the server (a timeout, a
reset connection, a throttled request): made again, it usually succeeds, so `call_with_retries`
retries those with backoff for up to UNBROKEN_STORAGE_RETRY_S seconds before the run fails.
Other failures are answers that no retry changes (missing, denied, a conditional write that
lost its race, a full disk) and are raised at once. Storage (unbroken.store.storage) makes
every remote call through `call_with_retries` and uses the predicates here to tell the two
kinds apart; Storage.full_error turns a full disk into an error with a hint.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from typing import TypeVar

import fsspec

from unbroken.errors import StorageError

log = logging.getLogger("unbroken")
T = TypeVar("T")

# How long an object-store operation is retried through transient faults before the run fails.
RETRY_ENV = "UNBROKEN_STORAGE_RETRY_S"
DEFAULT_RETRY_S = 120.0
_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError,
              StorageError)
_NETWORK_MODULES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "google", "azure")
# Among those libraries' own exception types (not OSError), the ones that mean "try again":
# a missing credential or a bad parameter is an answer, not a fault.
_TRANSIENT_NAMES = ("Connect", "Timeout", "Endpoint", "Disconnect", "Reset", "Incomplete", "Throttl",
                    "SlowDown", "Unavailable", "Payload", "Streaming")

_FULL = (errno.ENOSPC, errno.EDQUOT)


class PreconditionFailed(Exception):
    """A conditional write lost: the object was created or changed by someone else."""


def is_precondition_failed(e: BaseException) -> bool:
    """Is `e` an object store refusing a conditional write (its precondition no longer holds)?"""
    return "precondition" in str(e).lower().replace("-", "")


def is_not_implemented(e: BaseException) -> bool:
    """Is `e` a server saying it does not support the request (conditional writes, say)?"""
    return "notimplemented" in str(e).lower().replace(" ", "")


def is_transient(e: BaseException) -> bool:
    """Worth retrying: a network or server fault, not an answer (missing, denied, conflict)."""
    if isinstance(e, _PERMANENT) or is_precondition_failed(e) or is_not_implemented(e):
        return False
    if isinstance(e, (OSError, TimeoutError, ConnectionError)):
        return True
    name = type(e).__name__
    return type(e).__module__.split(".")[0] in _NETWORK_MODULES and any(t in name for t in _TRANSIENT_NAMES)


def retry_budget_s() -> float:
    """How long to retry transient faults: $UNBROKEN_STORAGE_RETRY_S seconds, else 120."""
    return float(os.environ.get(RETRY_ENV, DEFAULT_RETRY_S))


def is_full(e: BaseException) -> bool:
    """Is `e` the filesystem saying it has no space (or quota) left?"""
    return isinstance(e, OSError) and e.errno in _FULL


def call_with_retries(fs: fsspec.AbstractFileSystem, url: Callable[[], str], what: str,
                      fn: Callable[[], T]) -> T:
    """Run one remote operation on `fs` (the storage at `url()`, for messages), retrying transient
    faults with backoff for up to UNBROKEN_STORAGE_RETRY_S seconds and dropping the
    filesystem's cached listings before each retry."""
    deadline, delay, started = None, 0.2, time.monotonic()
    while True:
        try:
            return fn()
        except Exception as e:
            if not is_transient(e):
                raise
            now = time.monotonic()
            if deadline is None:
                deadline = now + retry_budget_s()
                log.warning("storage %s: %s failed (%s: %s); retrying with backoff for up to %g s",
                            url(), what, type(e).__name__, e, retry_budget_s())
            if now + delay > deadline:
                raise StorageError(
                    f"storage {url()!r} kept failing for {now - started:.0f} s while {what}: "
                    f"{type(e).__name__}: {e}. Hint: check the endpoint, credentials and network; "
                    f"committed checkpoints are intact and restore() continues the run once storage "
                    f"is back ({RETRY_ENV} sets how long to retry)") from e
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
            fs.invalidate_cache()
