"""Result: what a run produced, read from its directory (finished or not)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from unbroken import commit, history
from unbroken import manifest as mf
from unbroken.checkpoint import Checkpoint
from unbroken.errors import TornCheckpointError, TrainingFailedError
from unbroken.storage import Storage

log = logging.getLogger("unbroken")


@dataclass
class Result:
    """The last metrics, the latest checkpoint and the metric history of one run."""

    metrics: dict[str, Any] | None
    checkpoint: Checkpoint | None
    error: BaseException | None
    path: str
    best_checkpoints: list[tuple[Checkpoint, dict[str, Any]]] = field(default_factory=list)
    status: str | None = None
    rows: list[dict[str, Any]] = field(default_factory=list, repr=False)

    @property
    def metrics_dataframe(self) -> Any:
        """A pandas DataFrame with one row per training_iteration (built from `rows` on access)."""
        return history.to_dataframe(self.rows)

    @property
    def filesystem(self) -> Any:
        return Storage.from_url(self.path).fs

    @classmethod
    def from_path(cls, path: str, storage_filesystem: Any = None) -> Result:
        """Read any run directory: metrics each iteration once, latest committed checkpoint."""
        storage = Storage.from_url(path, storage_filesystem)
        manifest = mf.load(storage)
        rows = history.timeline(history.read_rows(storage))
        markers = {}
        names, _ = commit.scan(storage)
        for name in names:
            try:
                markers[name] = commit.read_marker(storage, name)
            except TornCheckpointError:
                continue
        fs = storage.filesystem_arg

        def handle(name: str) -> Checkpoint:
            return Checkpoint(storage.url(name), fs)

        latest = max(markers.values(), key=lambda m: m.iteration, default=None)
        error = None
        if manifest.status in (mf.ERRORED, mf.INTERRUPTED):
            summary = next((a.error for a in reversed(manifest.attempts) if a.error), manifest.status)
            error = TrainingFailedError(f"run {storage.url()!r} is {manifest.status}: {summary}")
        return cls(
            metrics=dict(rows[-1]) if rows else None,
            checkpoint=handle(latest.name) if latest else None,
            error=error,
            path=storage.url(),
            best_checkpoints=[(handle(n), markers[n].metrics) for n in manifest.best_checkpoints
                              if n in markers],
            status=manifest.status,
            rows=rows,
        )

    def __repr__(self) -> str:
        return (f"Result(metrics={self.metrics!r}, checkpoint={self.checkpoint!r}, "
                f"error={self.error!r}, path={self.path!r})")
