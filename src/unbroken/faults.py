"""Fault injection for crash tests: `UNBROKEN_FAULT=<point>[:<n>]` SIGKILLs this process
the n-th time (default: first) it passes `point`. Costs one dict lookup when unset."""

from __future__ import annotations

import os
import signal

_SPEC = os.environ.get("UNBROKEN_FAULT", "")
_POINT, _, _N = _SPEC.partition(":")
_count = 0


def point(name: str) -> None:
    global _count
    if _POINT and name == _POINT:
        _count += 1
        if _count >= int(_N or 1):
            os.kill(os.getpid(), signal.SIGKILL)
