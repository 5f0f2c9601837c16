"""Plain-text tables, times and saved arguments for the command line."""

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


def describe(value: Any) -> str:
    """A saved argument as Python-like text: dataclasses as Cls(field=...), functions by name."""
    if isinstance(value, dict):
        if "__ref__" in value:
            return value["__ref__"]
        if "__tuple__" in value:
            return "(" + ", ".join(describe(v) for v in value["__tuple__"]) + ")"
        if "__dataclass__" in value:
            defaults = _defaults(value["__dataclass__"])
            fields = ", ".join(f"{k}={describe(v)}" for k, v in value["fields"].items()
                               if v is not None and (k not in defaults or defaults[k] != v))
            return f"{value['__dataclass__'].rsplit(':', 1)[-1]}({fields})"
        return "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(describe(v) for v in value) + "]"
    return repr(value)


def _defaults(name: str) -> dict[str, Any]:
    """The encoded default fields of one of unbroken's own config dataclasses (others: none),
    so that a saved config shows only what was set."""
    if not name.startswith("unbroken."):
        return {}  # importing a user's module could run anything
    from unbroken.core.codec import encode, import_by_name

    try:
        return encode(import_by_name(name)())["fields"]
    except Exception:
        return {}
