"""`unbroken show <sweep directory>`: the sweep's status, its trials, its best trial, and what
its searcher and scheduler recorded. Read-only, as every `show` is."""

from __future__ import annotations

import json
from typing import Any

from unbroken.cli.tables import table, when
from unbroken.observe.progress import format_value
from unbroken.store import history
from unbroken.store import manifest as mf
from unbroken.store import sweep_manifest as sweep
from unbroken.store.lease import live_holder
from unbroken.store.storage import Storage

GONE = "its driver stopped without recording an end (killed?)"


def sweep_summary(path: str, storage_filesystem: Any = None) -> dict[str, Any]:
    """What `show` prints about the sweep at `path`, as plain data (also its --json form)."""
    storage = Storage.from_url(path, storage_filesystem)
    manifest = sweep.load(storage)
    driver = live_holder(storage) if manifest.status == mf.RUNNING else None
    aborted = manifest.status == mf.RUNNING and driver is None
    tune = (manifest.params.get("tune_config") or {}).get("fields", {})
    metric, mode = tune.get("metric"), tune.get("mode")
    trials = []
    for t in manifest.trials:
        run = storage.child(t.name)
        last = history.last_row(run) if mf.is_run_dir(run) else None
        status = mf.ABORTED if aborted and t.status == mf.RUNNING else t.status
        trials.append({"name": t.name, "status": status,
                       "iteration": (last or {}).get("training_iteration"),
                       "metric": (last or {}).get(metric) if metric else None,
                       "config": t.config, "error": t.error, "stopped_early": t.stopped_early,
                       "driver": t.driver, "relaunches": t.relaunches})
    scored = [t for t in trials
              if isinstance(t["metric"], (int, float)) and not isinstance(t["metric"], bool)]
    best = None
    if scored and mode in ("max", "min"):
        best = (max if mode == "max" else min)(scored, key=lambda t: t["metric"])["name"]
    return {"name": manifest.name, "path": storage.url(), "kind": "sweep",
            "status": mf.ABORTED if aborted else manifest.status, "recorded_status": manifest.status,
            "driver": driver, "created_at": manifest.created_at, "updated_at": manifest.updated_at,
            "metric": metric, "mode": mode, "best_trial": best, "num_samples": manifest.num_samples,
            "searcher": manifest.searcher, "scheduler": manifest.scheduler, "trials": trials,
            "ended": manifest.stopped, "running_s": manifest.running_s}


def print_sweep(s: dict[str, Any]) -> None:
    status = s["status"]
    if status != s["recorded_status"]:
        status += f" (sweep.json says {s['recorded_status']}; {GONE})"
    head = [["sweep", s["name"]], ["path", s["path"]], ["status", status],
            ["created", when(s["created_at"])], ["updated", when(s["updated_at"])]]
    if s.get("ended"):  # stop_all, the time budget or fail_fast ended it (tune.sweep_stop)
        head.append(["ended", f"{s['ended']['reason']}, {when(s['ended']['at'])}"])
    if s["metric"]:
        head.append(["metric", f"{s['metric']} ({s['mode']})"])
    if s["best_trial"]:
        best = next(t for t in s["trials"] if t["name"] == s["best_trial"])
        head.append(["best trial", f"{best['name']}: {s['metric']}={format_value(best['metric'])}"])
    print(table(None, head))
    print("\ntrials")
    placed = any(t.get("driver") for t in s["trials"])  # on a Ray cluster: where each driver ran
    rows = [[t["name"], t["status"]] + ([_loc(t)] if placed else [])
            + [t["iteration"] if t["iteration"] is not None else "-",
               format_value(t["metric"]) if t["metric"] is not None else "-", _short(t["config"]), _note(t)]
            for t in s["trials"]]
    header = ["NAME", "STATUS"] + (["LOC"] if placed else []) + ["ITER", (s["metric"] or "METRIC").upper(),
                                                                "CONFIG", "NOTE"]
    print(table(header, rows, indent=2) if rows else "  none yet")
    for what in ("searcher", "scheduler"):
        if s[what]:
            print(f"\n{what}\n  {_short(s[what], 300)}")
    print(f"\nhint: `unbroken ls {s['path']}` lists each trial as a run; `unbroken show "
          f"{s['path']}/<trial>` shows one")


def _loc(trial: dict[str, Any]) -> str:
    """Where the trial's driver ran, as Ray Tune's `loc` column: address:pid."""
    driver = trial.get("driver")
    return f"{driver['address']}:{driver['pid']}" if driver else "-"


def _note(trial: dict[str, Any]) -> str:
    notes = [trial["error"] or (f"stopped early: {trial['stopped_early']}" if trial["stopped_early"] else "")]
    if trial.get("relaunches"):
        notes.append(f"ran again {trial['relaunches']}x after its driver's node was lost")
    return "; ".join(n for n in notes if n) or "-"


def _short(value: Any, width: int = 60) -> str:
    text = json.dumps(value, default=repr, separators=(", ", ": "))
    return text if len(text) <= width else text[: width - 3] + "..."
