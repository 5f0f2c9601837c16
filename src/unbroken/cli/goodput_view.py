"""Where a run's time went, as `unbroken show` and `ls` print it (run.goodput's figures)."""

from __future__ import annotations

from typing import Any

from unbroken.run import goodput as gp

LABELS = {gp.PRODUCTIVE: "productive", gp.CHECKPOINT: "checkpoint stall", gp.STARTUP: "start-up",
          gp.RECOVERY: "recovery", gp.REDONE: "redone", gp.WAITING: "waiting for capacity",
          gp.PREEMPTION: "preemption", gp.OTHER: "other"}


def cell(time: dict[str, Any] | None) -> str:
    """The GOODPUT column of `ls`: '87.1%', or '-' before the first row."""
    figure = (time or {}).get("goodput")
    return "-" if figure is None else _percent(figure)


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
    return out + advice_lines(time.get("advice"))


def advice_lines(advice: dict[str, Any] | None) -> list[str]:
    """The checkpoint interval now and the one advised (docs/guarantees.md#how-often-to-checkpoint)."""
    if advice is None:
        return []
    failures = advice["failures"]
    seen = ("given" if advice["given"] else f"{failures} failure{'s' if failures != 1 else ''} seen"
            if failures else "assumed: no failure seen")
    now = advice["interval_s"]
    return [f"  checkpoints: a save blocks {_seconds(advice['cost_s'])}, every "
            + (f"{_seconds(now)} of training" if now is not None else "? (one save so far)")
            + f"; MTBF {_seconds(advice['mtbf_s'])} ({seen})"
            + (f", {_seconds(advice['recovery_s'])} to recover from each" if failures else ""),
            f"  advised interval (Young/Daly): every {_seconds(advice['advised_s'])} of training; "
            f"expected goodput {_percent(advice['expected_now']) if now is not None else '?'} now, "
            f"{_percent(advice['expected_advised'])} advised"]


def _percent(share: float) -> str:
    return f"{100 * share:.1f}%"


def _seconds(s: float) -> str:
    if s < 60:
        return f"{s:.2f} s"
    minutes, seconds = divmod(round(s), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {seconds:02d}s" if hours else f"{minutes}m {seconds:02d}s"
