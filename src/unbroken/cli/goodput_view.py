"""Where a run's time went, as `unbroken show` and `ls` print it (run.goodput's figures)."""

from __future__ import annotations

from typing import Any

from unbroken.run import goodput as gp

LABELS = {gp.PRODUCTIVE: "productive", gp.CHECKPOINT: "checkpoint stall", gp.STARTUP: "start-up",
          gp.RECOVERY: "recovery", gp.REDONE: "redone", gp.WAITING: "waiting for capacity",
          gp.OTHER: "other"}


def cell(time: dict[str, Any] | None) -> str:
    """The GOODPUT column of `ls`: '87.1%', or '-' before the first row."""
    figure = (time or {}).get("goodput")
    return "-" if figure is None else f"{100 * figure:.1f}%"


def lines(time: dict[str, Any] | None) -> list[str]:
    """The `time` section of `show`: the goodput, the wall time by kind, and each attempt's."""
    if not time or time.get("goodput") is None:
        return ["  no iteration recorded yet"]
    wall = time["wall_s"]
    out = [f"  goodput {cell(time)} of {_seconds(wall)} wall time"
           + (f" ({_seconds(time['between_fits_s'])} with no driver running, not counted)"
              if time.get("between_fits_s", 0) >= 0.05 else "")]
    for kind in gp.KINDS:
        seconds = time["seconds"][kind]
        if seconds >= 0.005 or kind == gp.PRODUCTIVE:
            out.append(f"  {LABELS[kind]:<21} {_seconds(seconds):>10}  {100 * seconds / wall:5.1f}%")
    if len(time["by_attempt"]) > 1:
        for number, kinds in time["by_attempt"].items():
            spent = ", ".join(f"{LABELS[k]} {_seconds(v)}" for k, v in kinds.items() if v >= 0.005)
            out.append(f"  attempt {number}: {spent}")
    return out


def _seconds(s: float) -> str:
    if s < 60:
        return f"{s:.2f} s"
    minutes, seconds = divmod(round(s), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {seconds:02d}s" if hours else f"{minutes}m {seconds:02d}s"
