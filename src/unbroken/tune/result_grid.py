"""ResultGrid: the results of a sweep's trials, read from the sweep directory."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

from unbroken.errors import TrainingFailedError, UnbrokenError, UnknownMetricError
from unbroken.run.result import Result
from unbroken.store import manifest as mf
from unbroken.store.storage import Storage
from unbroken.store.sweep_manifest import ERROR, TERMINATED, SweepManifest, TrialRecord
from unbroken.tune import pbt
from unbroken.tune import search_space as ss


@dataclass(repr=False)
class TrialResult(Result):
    """A trial's `Result`, with the trial's config, name and status in the sweep.

    `metrics` is the trial's last row, or `{}` (as in Ray Tune) for a trial that has none: one
    that never started, or that failed before its first report.
    """

    config: dict[str, Any] | None = None
    trial_name: str | None = None
    trial_status: str | None = None     # PENDING, RUNNING, TERMINATED, ERROR or INTERRUPTED
    stopped_early: str | None = None    # why the scheduler stopped it, if it did

    def __repr__(self) -> str:
        return (f"TrialResult(trial_name={self.trial_name!r}, trial_status={self.trial_status!r}, "
                f"config={self.config!r}, metrics={self.metrics!r}, error={self.error!r})")


def trial_result(storage: Storage, record: TrialRecord, config: dict[str, Any] | None) -> TrialResult:
    """Read one trial's run directory (a trial that never started has empty metrics)."""
    path = storage.child(record.name)
    base: Result | None = None
    if mf.is_run_dir(path):
        try:
            base = Result.from_path(path.url(), path.filesystem_arg)
        except (UnbrokenError, OSError, ValueError):
            base = None
    if base is None:
        base = Result(metrics=None, checkpoint=None, error=None, path=path.fs_path(),
                      _filesystem=path.filesystem)
    values = {f.name: getattr(base, f.name) for f in fields(Result)}
    if values["metrics"] is None:
        values["metrics"] = {}  # Ray's value for a trial without results: r.metrics.get(...) works
    if record.status == ERROR and values["error"] is None:
        values["error"] = TrainingFailedError(f"trial {record.name} of sweep {storage.url()!r} failed: "
                                              f"{record.error}")
    if record.status == TERMINATED:
        values["error"] = None  # e.g. stopped by the scheduler while its run was unfinished
    return TrialResult(**values, config=config, trial_name=record.name, trial_status=record.status,
                       stopped_early=record.stopped_early)


class ResultGrid:
    """The trials of a sweep, in trial order: `len()`, indexing and iteration give each
    trial's `Result` (a `TrialResult`, with `.config`)."""

    def __init__(self, path: str, manifest: SweepManifest, results: list[TrialResult],
                 metric: str | None = None, mode: str | None = None) -> None:
        self.experiment_path = path
        self._manifest = manifest
        self._results = results
        self._metric = metric
        self._mode = mode

    @classmethod
    def read(cls, storage: Storage, manifest: SweepManifest, space: dict[str, Any] | None,
             metric: str | None, mode: str | None) -> ResultGrid:
        results = []
        for record in manifest.trials:
            config = None
            if space is not None:
                try:
                    config = pbt.apply(ss.resolve(space, record.values), record.overrides or {})
                except UnbrokenError:
                    config = record.config
            results.append(trial_result(storage, record, config if space is not None else record.config))
        return cls(storage.url(), manifest, results, metric, mode)

    # -- container ------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._results)

    def __getitem__(self, i: int) -> TrialResult:
        return self._results[i]

    def __iter__(self) -> Iterator[TrialResult]:
        return iter(self._results)

    def __repr__(self) -> str:
        return (f"ResultGrid(path={self.experiment_path!r}, trials={len(self)}, "
                f"terminated={self.num_terminated}, errors={self.num_errors})")

    @property
    def status(self) -> str:
        """The sweep's status: FINISHED, RUNNING, INTERRUPTED or INCOMPLETE."""
        return self._manifest.status

    @property
    def errors(self) -> list[BaseException]:
        """The errors of the trials that failed."""
        return [r.error for r in self._results if r.trial_status == ERROR and r.error is not None]

    @property
    def num_errors(self) -> int:
        return sum(1 for r in self._results if r.trial_status == ERROR)

    @property
    def num_terminated(self) -> int:
        return sum(1 for r in self._results if r.trial_status == TERMINATED)

    # -- ranking --------------------------------------------------------------------------
    def _metric_mode(self, metric: str | None, mode: str | None) -> tuple[str, str]:
        metric = metric or self._metric
        mode = mode or self._mode
        if metric is None or mode not in ("min", "max"):
            raise ValueError("no metric and mode to rank trials by. Hint: get_best_result(metric='loss', "
                             "mode='min'), or set them in TuneConfig(metric=..., mode=...)")
        return metric, mode

    def get_best_result(self, metric: str | None = None, mode: str | None = None, scope: str = "last",
                        filter_nan_and_inf: bool = True) -> TrialResult:
        """The trial with the best `metric`: its last value (scope="last") or its best value in
        any row (scope="all"). Metric and mode default to TuneConfig's."""
        metric, mode = self._metric_mode(metric, mode)
        if scope not in ("last", "all"):
            raise ValueError(f"scope must be 'last' or 'all', got {scope!r}")
        best, best_value = None, None
        for result in self._results:
            value = _score(result, metric, mode, scope, filter_nan_and_inf)
            if value is None:
                continue
            if best_value is None or (value > best_value if mode == "max" else value < best_value):
                best, best_value = result, value
        if best is None:
            raise UnknownMetricError(
                f"no trial of sweep {self.experiment_path!r} reported the metric {metric!r}. Hint: check "
                "the name against the keys passed to tune.report / train.report")
        return best

    def get_dataframe(self, filter_metric: str | None = None, filter_mode: str | None = None) -> Any:
        """A pandas DataFrame with one row per trial: its last reported row (or, with
        filter_metric/filter_mode, its best row by that metric), the trial's name, status and
        path, and its config as `config/<key>` columns."""
        import pandas as pd

        rows = []
        for result in self._results:
            row: dict[str, Any] = {}
            if filter_metric is not None:
                if filter_mode not in ("min", "max"):
                    raise ValueError("get_dataframe(filter_metric=...) needs filter_mode='min' or 'max'")
                candidates = [r for r in result.rows if _finite(r.get(filter_metric))]
                if candidates:
                    pick = max if filter_mode == "max" else min
                    row.update(pick(candidates, key=lambda r: r[filter_metric]))
            elif result.metrics:
                row.update(result.metrics)
            row.update(trial_name=result.trial_name, trial_status=result.trial_status, logdir=result.path)
            for key, value in ss.flatten_config(result.config or {}).items():
                if key:
                    row[f"config/{key}"] = value
            rows.append(row)
        return pd.DataFrame(rows)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _score(result: Result, metric: str, mode: str, scope: str, filter_nan_and_inf: bool) -> float | None:
    if scope == "last":
        values = [result.metrics.get(metric)] if result.metrics else []
    else:
        values = [r.get(metric) for r in result.rows]
    ok = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if filter_nan_and_inf:
        ok = [v for v in ok if math.isfinite(v)]
    if not ok:
        return None
    return max(ok) if mode == "max" else min(ok)
