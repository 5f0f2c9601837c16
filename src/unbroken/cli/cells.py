"""One value as a cell of the command line's tables and lines: "-" for nothing, a size as
people read it, a row's metric as `name=value`."""

from __future__ import annotations

from typing import Any

from unbroken.core.units import format_bytes
from unbroken.observe.progress import format_value
from unbroken.run.callbacks import TIMINGS, numeric_metrics


def or_dash(value: Any) -> Any:
    """`value`, or "-" where there is none."""
    return "-" if value is None else value


def size(n: int | None) -> str:
    """A number of bytes as people read it, or "-"."""
    return "-" if n is None else format_bytes(n)


def metric(row: dict[str, Any] | None, name: str | None) -> str:
    """The metric `name` of `row` as `name=value`; without a name, its first measured metric
    (timings are not one); "-" when there is none."""
    if not row:
        return "-"
    if name:
        return f"{name}={format_value(row[name])}" if name in row else "-"
    for key in numeric_metrics(row):
        if key not in TIMINGS:
            return f"{key}={format_value(row[key])}"
    return "-"
