"""Backends set up what a framework needs in each worker before the training loop runs
(for torch: the process group) and tear it down after."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unbroken.worker.session import Session

RendezvousFn = Callable[[Any], Any]  # rank 0's value on every rank


class Backend:
    """No framework set-up (DataParallelTrainer without a backend_config)."""

    def on_start(self, session: Session, rendezvous: RendezvousFn) -> None:
        """Runs in each worker before the loop. `rendezvous(value)` returns rank 0's value on every rank."""

    def on_shutdown(self, session: Session) -> None:
        """Runs in each worker after the loop, also after a failure."""
