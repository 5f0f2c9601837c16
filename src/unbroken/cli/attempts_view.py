"""`unbroken show`'s attempts: the table, what each attempt adds to it, and the lineage of a
trial of population-based training."""

from __future__ import annotations

import json
from typing import Any

from unbroken.cli import inspection
from unbroken.cli.tables import table as _table
from unbroken.cli.tables import when as _when
from unbroken.store import manifest as mf
from unbroken.store.manifest import PBT_LINEAGE
from unbroken.store.storage import Storage


def show(s: inspection.RunSummary) -> None:
    """One row per attempt, then what the table has no room for: a changed configuration,
    the just-in-time checkpoint (or why there was none), a hang, a preemption notice, a slow
    rank; then, for a trial of population-based training, its lineage."""
    print("\nattempts")
    rows = [[a["number"], a["status"], _when(a["started_at"]), _when(a["ended_at"]), a["num_workers"],
             a["resumed_from"] or ("in place" if a.get("in_place") else "-"), a["error"] or "-"]
            for a in s.attempts]
    print(_table(["#", "STATUS", "STARTED", "ENDED", "WORKERS", "RESUMED FROM", "ERROR"], rows, indent=2)
          if rows else "  none")
    for previous, a in zip([None, *s.attempts], s.attempts, strict=False):
        _show_attempt_notes(a, previous)
    _show_lineage(s.path)


def _show_attempt_notes(a: dict[str, Any], previous: dict[str, Any] | None) -> None:
    if a.get("config_change"):
        print(f"  attempt {a['number']} continued the run with a changed configuration:")
        print("\n".join(f"  {line}" for line in mf.config_change_lines(a["config_change"])))
    jit = a.get("jit_checkpoint")
    if jit:
        print(f"  attempt {a['number']}: " + (
            f"rank {jit['rank']} saved iteration {jit['iteration']} just in time ({jit['seconds']} s)"
            if jit["iteration"] is not None else f"no just-in-time checkpoint: {jit['why_not']}"))
    hang = a.get("hang")
    if hang:
        print(f"  attempt {a['number']} hung waiting for rank(s) {hang['waited_for']}; stacks in "
              f".unbroken/stacks/attempt-{a['number']:03d}/:")
        for rank, at in hang["where"].items():
            print(f"    rank {rank}: {at or 'no answer (stopped, or gone)'}")
        if hang.get("killed"):
            print(f"    killed alone, so that the others could stay: rank(s) {hang['killed']}")
    peer = a.get("in_place")
    if peer:
        again = ", ".join(map(str, peer["replaced"])) or "none"
        dropped = (f"; went on without rank(s) {', '.join(map(str, peer['dropped']))} of attempt "
                   f"{a['number'] - 1} (lost with their node), the others numbered again"
                   if peer.get("dropped") else "")
        print(f"  attempt {a['number']}: recovered in place from iteration {peer['iteration']}: rank "
              f"{peer['source']} sent its state; ranks started again: {again}{dropped}")
    elastic = a.get("elastic")
    if elastic:
        before = f", {elastic['previous']} before" if elastic.get("previous") else ""
        gap = ""
        if previous and previous.get("ended_at"):
            seconds = a["started_at"] - previous["ended_at"]
            gap = f"; began {seconds:.1f} s after attempt {previous['number']} ended"
        print(f"  attempt {a['number']}: {a['num_workers']} workers, elastic: {elastic['reason']} "
              f"({elastic['capacity']} could be placed{before}){gap}")
    notice = a.get("preempted")
    if notice:
        ranks = "every rank" if notice["ranks"] is None else f"rank(s) {notice['ranks']}"
        print(f"  attempt {a['number']}: preempted: {notice['source']} at {_when(notice['received_at'])}, "
              f"{notice['node']} ({ranks}) to go by {_when(notice['deadline'])}")
    slow = (a.get("forward_s") or {}).get("straggler")
    if slow:
        own = a["forward_s"]["median_s"][slow["rank"]]
        print(f"  attempt {a['number']}: rank {slow['rank']} was slow: {own:.3g} s per report in the "
              f"model's forward pass, {slow['ratio']}x the other ranks' median")


def _show_lineage(path: str) -> None:
    """Each exploit of a trial of population-based training (`.unbroken/pbt.json`)."""
    try:
        lineage = json.loads(Storage.from_url(path).read_bytes(PBT_LINEAGE))
    except (FileNotFoundError, ValueError):
        return
    from unbroken.tune.pbt import differences  # only for a trial of PBT: importing tune takes a while

    print("\nlineage (population-based training)")
    def score(value: Any) -> str:
        return "-" if value is None else f"{value:.6g}"

    for e in lineage:
        changed = json.dumps(differences(e["old_config"], e["new_config"]), default=repr)
        print(f"  round {e['round']} at {e['t']:g}: took {e['donor']}/{e['checkpoint']} (score "
              f"{score(e['donor_score'])} against its {score(e['score'])}), then {changed}")
