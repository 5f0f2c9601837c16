"""The run manifest, `.unbroken/run.json`: what the run is and where it stands.

It is replaced atomically and carries a generation number; the previous generation is
kept in `run.prev.json` and used, with a warning, when the newest one does not load. The
fields and the save/load logic it shares with the sweep manifest live in manifest_base.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from unbroken.errors import RunNotFoundError
from unbroken.store.manifest_base import (
    META_DIR,
    Manifest,
    has_generation,
    known_fields,
    load_newest,
    new_id,
    versioned_fields,
    write_generation,
)
from unbroken.store.manifest_base import remove_stale_temps as remove_stale_temps
from unbroken.store.storage import Storage

# 2: pickled arguments are one file each under .unbroken/pickled/; 1 kept them in one pickled
# dict, .unbroken/trainer.pkl (still read, see pickled.SavedPickles).
SCHEMA_VERSION = 2
PICKLED_FILES_SINCE = 2
RUN_JSON = f"{META_DIR}/run.json"
RUN_PREV_JSON = f"{META_DIR}/run.prev.json"
RUN_FILES = (RUN_JSON, RUN_PREV_JSON)  # current and previous generation

RUNNING, FINISHED, ERRORED, INTERRUPTED = "RUNNING", "FINISHED", "ERRORED", "INTERRUPTED"
ABORTED = "ABORTED"  # an attempt whose driver died (e.g. SIGKILL) before it could record an end
RESIZED = "RESIZED"  # an attempt of an elastic run that stopped at a checkpoint to grow
PREEMPTED = "PREEMPTED"  # an attempt stopped at a checkpoint for a preemption notice


# A trial of population-based training: each exploit of its run (see unbroken.tune.population).
PBT_LINEAGE = f"{META_DIR}/pbt.json"
# Attempt fields left out of run.json while None, so that runs without them read as before.
OPTIONAL_FIELDS = ("config_change", "jit_checkpoint", "elastic", "in_place", "fit_started_at", "hang",
                   "forward_s", "checkpoint_stalls", "preempted")


@dataclass
class Attempt:
    """One try at the run: a fit() start or a worker-group restart."""

    number: int
    started_at: float
    resumed_from: str | None = None
    resumed_iteration: int = 0
    num_workers: int = 1
    ended_at: float | None = None
    status: str = RUNNING
    error: str | None = None
    # The identity the fit() that started this attempt changed, by key path:
    # {"train_loop_config.epochs": {"saved": 8, "now": 10}} (a side is absent where the key was).
    # Only in run.json when there is one, so that runs without changes read as before.
    config_change: dict[str, dict[str, Any]] | None = None
    # With TrainState(jit_checkpoint=True), what a failure of this attempt saved just in time:
    # {"iteration": 6, "rank": 0, "seconds": 0.05}, or {"iteration": None, "why_not": "..."}
    # (see unbroken.worker.recovery.just_in_time). Only in run.json when there is one.
    jit_checkpoint: dict[str, Any] | None = None
    # In an elastic run (ScalingConfig(num_workers=(min, max))), why this attempt has the size
    # it has: {"reason": "node lost", "capacity": 2, "previous": 3}; reasons: "start", "rank lost",
    # "node lost", "failure", "capacity returned". Only in run.json for elastic runs.
    elastic: dict[str, Any] | None = None
    # When this attempt recovered in place (FailureConfig(recovery="in_place")): the round it
    # resumed from, the rank that sent its state, the ranks that kept their processes and those
    # started again: {"iteration": 6, "source": 0, "kept": [0], "replaced": [1]}. Only in
    # run.json when there is one; `resumed_from` is then None (nothing was read from storage).
    in_place: dict[str, Any] | None = None
    # When the fit() that began this attempt started (time.time()): attempts of one fit() share
    # it, and the time from it to the first attempt is the run's start-up. Absent in runs
    # written before it was recorded (see run.goodput).
    fit_started_at: float | None = None
    # When hang_timeout_s ended this attempt: the ranks the others waited for and where each
    # rank's main thread was ("loops.py:75 in train_loop", None: no answer), from the stacks
    # kept in .unbroken/stacks/attempt-NNN/. Only in run.json when there is one.
    hang: dict[str, Any] | None = None
    # Each rank's median seconds in its model's forward passes per report, over the attempt's
    # last 10 reports, and the rank consistently slower than the others (see run.stragglers):
    # {"median_s": [0.021, 0.043], "straggler": {"rank": 1, "ratio": 2.05}}. Only in run.json
    # when measured (models wrapped by prepare_model in a run of 2 workers or more).
    forward_s: dict[str, Any] | None = None
    # Each round of this attempt that saved a checkpoint: its training_iteration (as a string)
    # and the longest any rank's loop was blocked saving it, in seconds (goodput's checkpoint
    # stall, the cost `checkpoint="auto"` weighs). Kept here, not in the metric rows, which
    # hold what the loop reported. Only in run.json when there is one.
    checkpoint_stalls: dict[str, float] | None = None
    # When a preemption notice stopped this attempt (status PREEMPTED): where it came from,
    # when, the deadline (time.time() seconds), the machine it named (a Ray node id, or a host
    # name) and its ranks (None: every rank): {"source": "SIGTERM", "received_at": ...,
    # "deadline": ..., "node": "host-1", "ranks": None}. Only in run.json when there is one.
    preempted: dict[str, Any] | None = None

    def stall_s(self, iteration: Any) -> float | None:
        """The checkpoint stall of round `iteration` of this attempt (None: it saved none)."""
        return checkpoint_stall(self.checkpoint_stalls, iteration)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Attempt:
        return cls(**known_fields(cls, raw))


def checkpoint_stall(stalls: dict[str, float] | None, iteration: Any) -> float | None:
    """The stall recorded in an attempt's `checkpoint_stalls` for round `iteration`, if any."""
    return None if not stalls else stalls.get(str(iteration))


def config_change_lines(change: dict[str, dict[str, Any]]) -> list[str]:
    """One line per changed key: `  key: saved X -> now Y` (values as JSON, "(absent)")."""
    def show(side: dict[str, Any], key: str) -> str:
        return json.dumps(side[key], default=repr) if key in side else "(absent)"
    return [f"  {key}: saved {show(sides, 'saved')} -> now {show(sides, 'now')}"
            for key, sides in sorted(change.items())]


@dataclass
class RunManifest(Manifest):
    """Contents of run.json. Field names are the on-disk format; see docs/storage-format.md.
    The creation and update times, generation and versions come from Manifest."""

    name: str
    trainer_class: str
    trainer_mro: list[str]
    params: dict[str, Any] = field(default_factory=dict)
    pickled_params: list[str] = field(default_factory=list)
    must_respecify: list[str] = field(default_factory=list)
    dataset_names: list[str] = field(default_factory=list)
    identity: dict[str, Any] = field(default_factory=dict)
    identity_fingerprint: str = ""
    code_fingerprints: dict[str, str] = field(default_factory=dict)
    status: str = RUNNING
    attempts: list[Attempt] = field(default_factory=list)
    latest_checkpoint: str | None = None
    best_checkpoints: list[str] = field(default_factory=list)
    run_id: str = field(default_factory=new_id)
    # Each rank's seed of its TrainState's per-step random streams, as the ranks armed for
    # just-in-time checkpoints said: later attempts of the same size keep them.
    step_seeds: list[int] | None = None
    schema_version: int = field(default=SCHEMA_VERSION, kw_only=True)

    def to_bytes(self) -> bytes:
        raw = self.to_dict()
        if raw["step_seeds"] is None:
            del raw["step_seeds"]
        for attempt in raw["attempts"]:
            for optional in OPTIONAL_FIELDS:
                if attempt[optional] is None:
                    del attempt[optional]
        return json.dumps(raw, indent=1, sort_keys=True, default=repr).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> RunManifest:
        raw = versioned_fields(json.loads(data), cls, SCHEMA_VERSION, where, "storage")
        raw["attempts"] = [Attempt.from_dict(a) for a in raw.get("attempts", [])]
        return cls(**raw)

    @property
    def attempt_count(self) -> int:
        return len(self.attempts)


def is_run_dir(storage: Storage) -> bool:
    """True if `storage` is a run directory (it has a run manifest, either generation)."""
    return has_generation(storage, RUN_FILES)


def load(storage: Storage) -> RunManifest:
    """Load the newest valid generation; raise a specific error if none is valid."""
    return load_newest(storage, RUN_FILES, RunManifest.from_bytes, "run",
                       missing_hint="check the path; a run is <storage_path>/<name>",
                       not_a_dir=RunNotFoundError, none_here=_no_run,
                       untouched="checkpoints in the directory are untouched")


def _no_run(storage: Storage) -> RunNotFoundError:
    """The error for a directory that holds no run manifest."""
    return RunNotFoundError(
        f"no run at {storage.url()!r}: it has no {RUN_JSON}. Hint: pass a run directory "
        "(<storage_path>/<name>), or start a new run there with fit()")


def save(storage: Storage, manifest: RunManifest, previous: bytes | None) -> bytes:
    """Write a new generation; `previous` (the bytes last written) becomes the fallback."""
    return write_generation(storage, RUN_FILES, manifest, previous)
