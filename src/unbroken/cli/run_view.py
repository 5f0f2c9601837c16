"""`unbroken show <run directory>`: the run's identity and status, its attempts, where its
time went, its checkpoints, its saved arguments and its last metrics. Read-only, as every
`show` is."""

from __future__ import annotations

import json
import time

from unbroken.cli import attempts_view, goodput_view, inspection
from unbroken.cli.cells import or_dash as _or_dash
from unbroken.cli.cells import size as _size
from unbroken.cli.tables import describe
from unbroken.cli.tables import table as _table
from unbroken.cli.tables import when as _when
from unbroken.observe.progress import format_value


def print_run(s: inspection.RunSummary) -> None:
    """Every section `show` prints for one run, in order."""
    _show_head(s)
    attempts_view.show(s)
    print("\ntime (docs/guarantees.md#where-the-time-went)")
    print("\n".join(goodput_view.lines(s.time)))
    _show_checkpoints(s)
    _show_config(s)
    _show_last_metrics(s)


def _show_head(s: inspection.RunSummary) -> None:
    """The run's identity and status; a run.json that still says RUNNING after its driver died
    is shown with the status it really has, and a live driver with its heartbeat's age."""
    status = s.status
    if s.status != s.recorded_status:
        status += f" (run.json says {s.recorded_status}; {inspection.ABORTED_NOTE})"
    head = [["run", s.name], ["path", s.path], ["status", status], ["trainer", s.trainer_class],
            ["run id", s.run_id], ["created", _when(s.created_at)], ["updated", _when(s.updated_at)]]
    if s.driver:
        age = time.time() - float(s.driver.get("heartbeat", 0))
        head.append(["driver", f"pid {s.driver.get('pid')} on {s.driver.get('host')} "
                               f"(heartbeat {age:.0f} s ago)"])
    print(_table(None, head))


def _show_checkpoints(s: inspection.RunSummary) -> None:
    print("\ncheckpoints (file sizes checked; `unbroken verify` also checks hashes)")
    rows = [[c.name, _state(c), _or_dash(c.iteration), _or_dash(c.attempt), _or_dash(c.files),
             _size(c.bytes), _when(c.committed_at)] for c in s.checkpoints or []]
    validated = any(c.validation for c in s.checkpoints or [])
    if validated:
        for row, c in zip(rows, s.checkpoints or [], strict=True):
            row.append(_validation(c))
    print(_table(["NAME", "STATE", "ITER", "ATTEMPT", "FILES", "SIZE", "COMMITTED"]
                 + (["VALIDATION"] if validated else []), rows, indent=2) if rows else "  none")


def _state(c: inspection.CheckpointState) -> str:
    if c.state in (inspection.TORN, inspection.CORRUPTED):
        return f"{c.state}: {'; '.join(c.problems)}"
    return c.state


def _validation(c: inspection.CheckpointState) -> str:
    """A checkpoint's validation in a cell: its status, and what it returned or why it failed."""
    if c.validation is None:
        return "-"
    if c.validation_metrics:
        values = " ".join(f"{k}={format_value(v)}" for k, v in sorted(c.validation_metrics.items()))
        return f"{c.validation} {values}"
    lines = c.validation_error.strip().splitlines()
    return f"{c.validation}: {lines[-1][:80]}" if lines else c.validation


def _show_config(s: inspection.RunSummary) -> None:
    """The trainer's saved arguments: train_loop_config as JSON, the others as Python-like text,
    and the names of those that could only be pickled."""
    print("\nconfig")
    args_rows = [["train_loop_config", json.dumps(s.config, sort_keys=True)]] if s.config is not None else []
    args_rows += [[name, describe(value)] for name, value in sorted(s.params.items())
                  if name != "train_loop_config" and value is not None]
    args_rows += [[name, "(pickled)"] for name in s.pickled_params]
    print(_table(None, args_rows, indent=2) if args_rows else "  none")


def _show_last_metrics(s: inspection.RunSummary) -> None:
    """The last reported row (nothing when the run reported none), its timestamp as a date."""
    if not s.last_metrics:
        return
    m = s.last_metrics
    print(f"\nlast metrics (iteration {m.get('training_iteration')}, attempt {m.get('attempt')})")
    shown = {k: v for k, v in m.items() if k not in ("training_iteration", "attempt") and v is not None}
    if "timestamp" in shown:
        shown["timestamp"] = _when(shown["timestamp"])
    print(_table(None, [[k, format_value(v)] for k, v in shown.items()], indent=2))
