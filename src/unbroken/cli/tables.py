"""Plain-text tables and times for the command line."""

from __future__ import annotations

import time
from typing import Any


def table(headers: list[str] | None, rows: list[list[Any]], indent: int = 0) -> str:
    """Left-aligned columns, two spaces apart; the last column is never padded."""
    cells = [[str(c) for c in row] for row in ([headers] if headers else []) + rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]) - 1)]
    return "\n".join(" " * indent + "".join(c.ljust(w + 2) for c, w in zip(row, widths, strict=False))
                     + row[-1] for row in cells)


def when(t: float | None) -> str:
    """A Unix time as local `YYYY-mm-dd HH:MM:SS`, or "-"."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"
