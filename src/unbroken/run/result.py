"""Result: what a run produced, read from its directory (finished or not)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from unbroken.errors import RunNotFoundError, TornCheckpointError, TrainingFailedError, UnknownMetricError
from unbroken.run import goodput
from unbroken.run.goodput import Goodput
from unbroken.store import commit, history, return_value, validation_record
from unbroken.store import manifest as mf
from unbroken.store.checkpoint import Checkpoint
from unbroken.store.storage import Storage

log = logging.getLogger("unbroken")


@dataclass
class Result:
    """The last metrics, the latest checkpoint and the metric history of one run.

    `best_checkpoints` are the kept checkpoints that rank, in Ray's order: worst first and
    the best last by `checkpoint_score_attribute`, or oldest first without one
    (`best_checkpoints[-1]` is the best, as in Ray).

    As Ray's, `path` is the run directory's path on `filesystem` (no URL scheme);
    `url` adds the scheme (`s3://bucket/...`), which is what `unbroken show` takes.
    """

    metrics: dict[str, Any] | None
    checkpoint: Checkpoint | None
    error: BaseException | None
    path: str
    best_checkpoints: list[tuple[Checkpoint, dict[str, Any]]] = field(default_factory=list)
    status: str | None = None
    # The timeline's rows, read from `path` on first use (`rows`): a history can be long.
    _rows: list[dict[str, Any]] | None = field(default=None, repr=False)
    _filesystem: Any = field(default=None, repr=False)
    # Every committed checkpoint with its row, oldest first (get_best_checkpoint ranks them).
    checkpoints: list[tuple[Checkpoint, dict[str, Any]]] = field(default_factory=list, repr=False)
    # The attempt whose training function's return value `return_value` reads (0: none).
    _returned_in: int = field(default=0, repr=False)

    @property
    def rows(self) -> list[dict[str, Any]]:
        """Every metric row of the timeline (each iteration once), oldest first."""
        if self._rows is None:
            storage = Storage.from_url(self.path, self._filesystem)
            self._rows = history.timeline(history.read_rows(storage)) if mf.is_run_dir(storage) else []
        return self._rows

    def time_spent(self) -> Goodput:
        """Where the run's time went, read from its directory now: `.goodput` (productive /
        wall), `.seconds` by kind, `.by_attempt` (docs/guarantees.md#where-the-time-went)."""
        return goodput.of_storage(Storage.from_url(self.path, self._filesystem))

    @property
    def return_value(self) -> Any:
        """What the training function returned on rank 0 (Ray Train V2), or None when it
        returned nothing, or the run did not finish. Read on access: a value that is not plain
        data was pickled, and reading it unpickles it (trust the run directory)."""
        if not self._returned_in:
            return None
        return return_value.load(Storage.from_url(self.path, self._filesystem), self._returned_in)

    def get_best_checkpoint(self, metric: str, mode: str) -> Checkpoint | None:
        """The committed checkpoint whose row has the highest (`mode="max"`) or lowest
        (`"min"`) `metric`, the newest on a tie; None when the run has no checkpoint.
        UnknownMetricError when no checkpoint's row has the metric."""
        if mode not in ("max", "min"):
            raise ValueError(f"get_best_checkpoint(mode=...) must be 'max' or 'min', got {mode!r}")
        candidates = self.checkpoints or self.best_checkpoints  # a Result built by hand has only these
        if not candidates:
            return None
        scored = [(c, m[metric]) for c, m in candidates
                  if isinstance(m.get(metric), (int, float)) and not isinstance(m.get(metric), bool)]
        if not scored:
            raise UnknownMetricError(
                f"no checkpoint of run {self.url!r} has a numeric metric {metric!r}. Hint: the rows "
                f"of its checkpoints have: {', '.join(sorted(self.checkpoints[-1][1]))}")
        sign = 1 if mode == "max" else -1
        best = max(range(len(scored)), key=lambda i: (sign * scored[i][1], i))
        return scored[best][0]

    @property
    def metrics_dataframe(self) -> Any:
        """A pandas DataFrame with one row per training_iteration (built from `rows` on access)."""
        return history.to_dataframe(self.rows)

    @property
    def filesystem(self) -> Any:
        """The fsspec filesystem `path` is on (with `path`, what opens the run again)."""
        return self._filesystem or Storage.from_url(self.path).filesystem

    @property
    def url(self) -> str:
        """The run directory as one string: `path` with its filesystem's scheme."""
        return Storage.from_url(self.path, self._filesystem).url()

    @classmethod
    def from_path(cls, path: str | os.PathLike, storage_filesystem: Any = None) -> Result:
        """Read any run directory: metrics each iteration once, latest committed checkpoint."""
        path = os.fspath(path)
        storage = Storage.from_url(path, storage_filesystem)
        try:
            manifest = mf.load(storage)
        except RunNotFoundError as e:
            if storage_filesystem is None and "://" not in path and not os.path.isabs(path):
                raise RunNotFoundError(f"{e}. A Result.path on an object store has no scheme, as in "
                                       "Ray: pass storage_filesystem=result.filesystem with it, or "
                                       "pass result.url") from None
            raise
        last = history.last_row(storage)
        markers = {}
        names, _ = commit.scan(storage)
        for name in names:
            try:
                markers[name] = commit.read_marker(storage, name)
            except TornCheckpointError:
                continue
        fs = storage.filesystem
        records = validation_record.read_all(storage, list(markers.values()))

        def metrics(name: str) -> dict[str, Any]:
            return validation_record.metrics(markers[name], records.get(name))

        def handle(name: str) -> Checkpoint:
            return Checkpoint(storage.url(name), fs)

        latest = max(markers.values(), key=lambda m: m.iteration, default=None)
        error = None
        if manifest.status in (mf.ERRORED, mf.INTERRUPTED):
            summary = next((a.error for a in reversed(manifest.attempts) if a.error), manifest.status)
            error = TrainingFailedError(f"run {storage.url()!r} is {manifest.status}: {summary}")
        return cls(
            metrics=dict(last) if last else None,
            checkpoint=handle(latest.name) if latest else None,
            error=error,
            path=storage.fs_path(),
            # Ray's order: the best last (by score; without one, the newest last).
            best_checkpoints=[(handle(n), metrics(n)) for n in reversed(manifest.best_checkpoints)
                              if n in markers],
            status=manifest.status,
            _filesystem=fs,
            checkpoints=[(handle(n), metrics(n)) for n in markers],
            _returned_in=manifest.attempt_count if manifest.status == mf.FINISHED else 0,
        )

    def __repr__(self) -> str:
        return (f"Result(metrics={self.metrics!r}, checkpoint={self.checkpoint!r}, "
                f"error={self.error!r}, path={self.path!r})")
