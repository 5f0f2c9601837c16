"""Pictures of one run as PNGs. `plot_run`: metric curves, the timeline (each iteration once)
drawn solid, the rows of abandoned attempts (recorded after the checkpoint a later attempt
resumed from) drawn faded, and a dotted line where each later attempt resumed. `plot_goodput`:
the run's wall-clock time as bands of what it went into (run.goodput), under its progress."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from unbroken.cli.inspection import run_name
from unbroken.errors import UnknownMetricError
from unbroken.run import goodput as gp
from unbroken.run.callbacks import TIMINGS, numeric_metrics
from unbroken.store import history
from unbroken.store import manifest as mf
from unbroken.store.lease import live_holder
from unbroken.store.storage import Storage


def metric_names(rows: list[dict[str, Any]]) -> list[str]:
    """Numeric metrics in first-seen order, measured ones before the automatic timings."""
    names = list(dict.fromkeys(k for row in rows for k in numeric_metrics(row)))
    return [n for n in names if n not in TIMINGS] + [n for n in names if n in TIMINGS]


def plot_run(path: str, out: str | os.PathLike, metrics: list[str] | None = None,
             storage_filesystem: Any = None) -> list[str]:
    """Draw `metrics` (default: every measured metric) of the run at `path` against
    training_iteration into the PNG `out`; returns the metrics drawn."""
    storage = Storage.from_url(path, storage_filesystem)
    manifest = mf.load(storage)
    rows = [r for r in history.read_rows(storage) if "training_iteration" in r]
    available = metric_names(rows)
    if not available:
        raise ValueError(f"run {storage.url()!r} has no numeric metrics to plot yet")
    unknown = [m for m in metrics or [] if m not in available]
    if unknown:
        raise UnknownMetricError(f"run {run_name(storage)!r} has no metric {', '.join(map(repr, unknown))}. "
                         f"Hint: choose from {', '.join(available)}")
    chosen = list(metrics or [m for m in available if m not in TIMINGS] or available)
    plt = _pyplot()
    from matplotlib.transforms import blended_transform_factory

    kept = history.timeline(rows)
    on_timeline = {id(r) for r in kept}
    abandoned: dict[int, list[dict]] = {}
    for row in rows:
        if id(row) not in on_timeline:
            abandoned.setdefault(row.get("attempt", 0), []).append(row)
    restarts = manifest.attempts[1:]

    fig, axes = plt.subplots(len(chosen), 1, sharex=True, squeeze=False,
                             figsize=(8, 1.2 + 2.2 * len(chosen)))
    for i, (ax, metric) in enumerate(zip(axes[:, 0], chosen, strict=True)):
        xs, ys = _series(kept, metric)
        ax.plot(xs, ys, color="C0", lw=1.8, marker="." if len(xs) < 60 else None, label="timeline")
        for attempt, group in sorted(abandoned.items()):
            xs, ys = _series(group, metric)
            if xs:
                ax.plot(xs, ys, color="0.45", alpha=0.5, lw=1.2, ls="--", marker="x",
                        label=f"abandoned rows (attempt {attempt})")
        for a in restarts:
            ax.axvline(a.resumed_iteration, color="0.35", ls=":", lw=1.2)
            if i == 0:
                where = blended_transform_factory(ax.transData, ax.transAxes)
                ax.text(a.resumed_iteration, 1.02, marker_label(a), transform=where,
                        ha="center", va="bottom", fontsize=8, color="0.25")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.25)
    axes[0, 0].legend(loc="best", fontsize=8)
    axes[-1, 0].set_xlabel("training_iteration")
    alive = manifest.status != mf.RUNNING or live_holder(storage) is not None
    status = manifest.status if alive else mf.ABORTED
    fig.suptitle(f"{run_name(storage)} ({status}, {manifest.attempt_count} attempt"
                 f"{'s' if manifest.attempt_count != 1 else ''})")
    fig.tight_layout()
    fig.savefig(os.fspath(out), dpi=100)
    plt.close(fig)
    return chosen


def marker_label(attempt: mf.Attempt) -> str:
    """The label of the line where `attempt` resumed: its number, and for an elastic run its
    size and why ("attempt 3: 2 workers, node lost")."""
    if attempt.elastic:
        return f"attempt {attempt.number}: {attempt.num_workers} workers, {attempt.elastic['reason']}"
    return f"attempt {attempt.number}"


def _series(rows: list[dict], metric: str) -> tuple[list[float], list[float]]:
    pairs = [(r["training_iteration"], r[metric]) for r in rows if metric in r
             and isinstance(r[metric], (int, float)) and not isinstance(r[metric], bool)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plotting needs matplotlib. Hint: pip install 'unbroken[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


COLORS = {gp.PRODUCTIVE: "#2ca02c", gp.CHECKPOINT: "#1f77b4", gp.STARTUP: "#9467bd",
          gp.RECOVERY: "#d62728", gp.REDONE: "#ff7f0e", gp.WAITING: "#bcbd22",
          gp.PREEMPTION: "#8c564b", gp.OTHER: "#7f7f7f"}


def plot_goodput(path: str, out: str | os.PathLike, storage_filesystem: Any = None) -> dict[str, float]:
    """Draw where the run at `path` spent its time into the PNG `out`: above, each row's
    iteration against wall-clock time (the rows a later attempt redid faded); below, the time
    as bands by kind, with each attempt's start and each failure marked. Returns the seconds
    by kind."""
    storage = Storage.from_url(path, storage_filesystem)
    manifest = mf.load(storage)
    rows = history.read_rows(storage)
    time = gp.of_run([dataclasses.asdict(a) for a in manifest.attempts], rows)
    if not time.segments:
        raise ValueError(f"run {storage.url()!r} has no iteration recorded yet: nothing to draw")
    plt = _pyplot()
    t0 = time.segments[0].start
    fig, (top, bands) = plt.subplots(2, 1, sharex=True, figsize=(10, 4.2),
                                     gridspec_kw={"height_ratios": [3, 1]})
    kept = {id(r) for r in history.timeline(rows)}
    styles = ((False, {"color": "C0", "s": 6}), (True, {"color": "0.55", "s": 10, "marker": "x"}))
    for redone, style in styles:
        chosen = [r for r in rows if "timestamp" in r and (id(r) not in kept) == redone]
        top.scatter([r["timestamp"] - t0 for r in chosen], [r.get("training_iteration", 0) for r in chosen],
                    label="redone" if redone else "kept", **style)
    top.set_ylabel("training_iteration")
    top.legend(loc="upper left", fontsize=8)
    seconds = time.seconds
    for kind in gp.KINDS:
        spans = [(s.start - t0, s.end - s.start) for s in time.segments if s.kind == kind]
        if spans:
            bands.broken_barh(spans, (0, 1), color=COLORS[kind],
                              label=f"{kind} {100 * seconds[kind] / time.wall_s:.1f} %")
    for a in manifest.attempts:
        for ax in (top, bands):
            ax.axvline(a.started_at - t0, color="0.3", ls=":", lw=1)
        label = marker_label(a) if len(manifest.attempts) <= 6 else str(a.number)  # many: numbers only
        top.annotate(label, (a.started_at - t0, 1.0), xycoords=("data", "axes fraction"),
                     fontsize=7, ha="left", va="bottom", color="0.25")
        if a.status in (mf.ERRORED, mf.ABORTED) and a.ended_at is not None:
            bands.plot([a.ended_at - t0], [1.15], marker="v", color="#d62728", clip_on=False)
    bands.set_yticks([])
    bands.set_xlabel("seconds since the run started")
    bands.legend(loc="upper center", bbox_to_anchor=(0.5, -0.55), ncol=4, fontsize=8, frameon=False)
    fig.suptitle(f"{run_name(storage)}: goodput {100 * (time.goodput or 0):.1f} % of {time.wall_s:.1f} s")
    fig.tight_layout()
    fig.savefig(os.fspath(out), dpi=100)
    plt.close(fig)
    return seconds
