"""The sweep manifest, `<sweep>/.unbroken/sweep.json`: what the sweep is and where each
trial stands.

Like a run's manifest it is replaced atomically and carries a generation number; the
previous generation is kept in `sweep.prev.json` and used, with a warning, when the newest
one does not load. Only the sweep driver that holds the sweep's lease writes it. The fields
and the save/load logic it shares with the run manifest live in manifest_base.

Each trial is an ordinary run directory `<sweep>/<trial name>/`; the manifest records the
trial's stored search-space values (enough to rebuild its config), its status in the sweep
and its searcher id. A trial's own run.json stays the authority on how far its run got.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from unbroken.errors import NotASweepError
from unbroken.store.manifest import is_run_dir as is_run_dir
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
from unbroken.store.storage import Storage

# 2: the pickled Tuner arguments are one file each under .unbroken/pickled/tuner/, and a Trainer
# trainable's under .unbroken/pickled/trainable/; 1 kept them in two pickled dicts, tuner.pkl
# and trainer.pkl (still read, only when needed and allowed).
SCHEMA_VERSION = 2
SWEEP_JSON = f"{META_DIR}/sweep.json"
SWEEP_PREV_JSON = f"{META_DIR}/sweep.prev.json"
SWEEP_FILES = (SWEEP_JSON, SWEEP_PREV_JSON)  # current and previous generation
TUNER_PICKLED = f"{META_DIR}/pickled/tuner"
TRAINABLE_PICKLED = f"{META_DIR}/pickled/trainable"
LEGACY_TUNER_PKL = f"{META_DIR}/tuner.pkl"
LEGACY_TRAINER_PKL = f"{META_DIR}/trainer.pkl"
RESTARTED_DIR = f"{META_DIR}/restarted"

# Trial statuses (Ray Tune's names, plus INTERRUPTED for a trial stopped by a signal).
PENDING, RUNNING, TERMINATED, ERROR, INTERRUPTED = "PENDING", "RUNNING", "TERMINATED", "ERROR", "INTERRUPTED"
PAUSED = "PAUSED"  # population-based training: stopped at a perturbation point, to run again
DONE = (TERMINATED, ERROR)
UNFINISHED = (PENDING, RUNNING, INTERRUPTED, PAUSED)
# Sweep statuses. INCOMPLETE: fit() ended with unfinished trials left unrun on purpose
# (Tuner.restore(resume_unfinished=False)).
SWEEP_RUNNING, SWEEP_FINISHED, SWEEP_INTERRUPTED, SWEEP_INCOMPLETE = (
    "RUNNING", "FINISHED", "INTERRUPTED", "INCOMPLETE")


@dataclass
class TrialRecord:
    """One trial of the sweep."""

    index: int
    name: str
    values: dict[str, Any]             # stored search-space values by path (search_space.sample)
    config: Any = None                 # the trial's config as JSON, for reading (objects by type)
    status: str = PENDING
    searcher_id: int | None = None     # e.g. the Optuna trial number
    told: bool = False                 # the searcher has been told this trial's outcome
    error: str | None = None
    stopped_early: str | None = None   # why the scheduler stopped it (it is TERMINATED)
    reruns: int = 0                    # times an errored trial was resumed or restarted
    overrides: dict[str, Any] | None = None  # config values population-based training set, by path
    restarts: int = 0                  # times it was restarted from scratch (old dir kept aside)
    driver: dict[str, Any] | None = None  # on a Ray cluster: its driver actor's node_id, address, pid
    relaunches: int = 0                # times it ran again because its driver was lost with its node
    started_at: float | None = None
    ended_at: float | None = None
    results_seen: int = 0              # the last iteration the sweep callbacks were given (tune.callback)
    # What else the sweep callbacks were given (tune.callback, tune.trial_events): the last
    # checkpoint, as [attempt, iteration]; the last attempt restored; the last failed attempt
    # retried; whether the trial's end is still to be told.
    saves_seen: list[int] | None = None
    restores_seen: int = 0
    recovers_seen: int = 0
    end_due: bool = False
    title: str | None = None           # the name TuneConfig(trial_name_creator) gave it (tune.trial_naming)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        super().__setattr__("_json", None)  # what `to_json` returns changes with any field

    def to_json(self) -> str:
        """The record as one line of JSON, kept until a field is set again: a sweep's manifest
        is saved twice per trial, and encoding every record at each save made a sweep's cost
        grow with the square of its trials (the config and values dicts are never changed in
        place, only replaced)."""
        if self._json is None:
            super().__setattr__("_json", json.dumps(asdict(self), default=repr))
        return self._json


_TRIALS = "\x00trials\x00"  # where the trial records go in the encoded manifest


@dataclass
class SweepManifest(Manifest):
    """Contents of sweep.json; field names are the on-disk format (docs/sweeps.md). The
    creation and update times, generation and versions come from Manifest."""

    name: str
    seed: int
    kind: str = "sweep"
    status: str = SWEEP_RUNNING
    seed_given: bool = False
    identity: dict[str, Any] = field(default_factory=dict)
    trainable: dict[str, Any] = field(default_factory=dict)  # kind, name, and a trainer's encoded fields
    params: dict[str, Any] = field(default_factory=dict)     # JSON-encoded Tuner arguments
    pickled_params: list[str] = field(default_factory=list)  # the ones pickled instead
    searcher: dict[str, Any] = field(default_factory=dict)   # the search algorithm's description
    scheduler: dict[str, Any] | None = None
    num_samples: int = 1
    max_concurrent_trials: int | None = None
    total_trials: int = 0
    trials: list[TrialRecord] = field(default_factory=list)
    sweep_id: str = field(default_factory=new_id)
    # Seconds sweep drivers have spent running the sweep, all fit() calls together (what
    # TuneConfig(time_budget_s) and TimeoutStopper count).
    running_s: float = 0.0
    # Why the sweep was ended before its trials were all done, and when: {"reason":
    # "ExperimentPlateauStopper.stop_all()", "at": 1767000000.0} (see tune.sweep_stop).
    stopped: dict[str, Any] | None = None
    # The sweep callbacks' get_state(), saved with the marks above (see tune.callback_state).
    callback_states: list[dict[str, Any]] | None = None
    schema_version: int = field(default=SCHEMA_VERSION, kw_only=True)

    def to_bytes(self) -> bytes:
        """Indented JSON, each trial record on a line of its own (encoded once per change, see
        TrialRecord.to_json). Not sort_keys: configs keep the key order of the user's
        param_space."""
        trials, self.trials = self.trials, []
        try:
            raw = self.to_dict()
        finally:
            self.trials = trials
        raw["trials"] = _TRIALS
        text = json.dumps(raw, indent=1, default=repr)
        listed = "[\n" + ",\n".join("  " + t.to_json() for t in trials) + "\n ]" if trials else "[]"
        return text.replace(json.dumps(_TRIALS), listed, 1).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> SweepManifest:
        raw = json.loads(data)
        if not isinstance(raw, dict) or raw.get("kind") != "sweep":
            raise ValueError("not a sweep manifest")
        raw = versioned_fields(raw, cls, SCHEMA_VERSION, f"sweep {where}", "sweep")
        raw["trials"] = [TrialRecord(**known_fields(TrialRecord, t)) for t in raw.get("trials", [])]
        return cls(**raw)

    def trial(self, name: str) -> TrialRecord | None:
        return next((t for t in self.trials if t.name == name), None)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.trials:
            out[t.status] = out.get(t.status, 0) + 1
        return out


def trial_name(index: int) -> str:
    return f"trial_{index:05d}"


def is_sweep_dir(storage: Storage) -> bool:
    """True if `storage` is a sweep root (it has a sweep manifest)."""
    try:
        return has_generation(storage, SWEEP_FILES)
    except OSError:
        return False


def load(storage: Storage) -> SweepManifest:
    """The newest valid generation of the sweep manifest; a specific error if there is none."""
    return load_newest(storage, SWEEP_FILES, SweepManifest.from_bytes, "sweep",
                       missing_hint="a sweep is <storage_path>/<RunConfig name>",
                       not_a_dir=NotASweepError, none_here=not_a_sweep,
                       untouched="the trial directories are untouched")


def not_a_sweep(storage: Storage) -> NotASweepError:
    """The error for a path that exists but is not a sweep root, with the likely fix."""
    where = storage.url()
    parent = storage.parent()
    if is_run_dir(storage):
        if is_sweep_dir(parent):
            return NotASweepError(
                f"{where!r} is one trial of the sweep at {parent.url()!r}, not a sweep. Hint: "
                f"Tuner.restore({parent.url()!r}, trainable) restores the sweep; "
                f"DataParallelTrainer.restore({where!r}) restores this trial as a single run")
        return NotASweepError(
            f"{where!r} is a single run, not a sweep. Hint: restore it with its trainer class, e.g. "
            f"TorchTrainer.restore({where!r}) or BaseTrainer.restore({where!r})")
    return NotASweepError(f"{where!r} is not a sweep: it has no {SWEEP_JSON}. Hint: pass a sweep "
                          "directory (<storage_path>/<name> of a Tuner), or start one with Tuner(...).fit()")


def save(storage: Storage, manifest: SweepManifest, previous: bytes | None) -> bytes:
    """Write a new generation; `previous` (the bytes last written) becomes the fallback."""
    return write_generation(storage, SWEEP_FILES, manifest, previous)


def summarize(path: str, storage_filesystem: Any = None) -> dict[str, Any]:
    """A brief, read-only summary of the sweep at `path` (for listings such as `unbroken ls`):
    name, status, trial counts by status, and each trial's name, status and path."""
    storage = Storage.from_url(path, storage_filesystem)
    manifest = load(storage)
    return {"name": manifest.name, "path": storage.url(), "kind": "sweep", "status": manifest.status,
            "num_trials": len(manifest.trials), "total_trials": manifest.total_trials,
            "counts": manifest.counts(), "updated_at": manifest.updated_at,
            "trials": [{"name": t.name, "status": t.status, "path": storage.url(t.name),
                        "config": t.config, "error": t.error, "stopped_early": t.stopped_early}
                       for t in manifest.trials]}
