"""Read-only inspection of run directories: what `unbroken ls`, `show` and `verify` report.

`list_runs(root)` and `summarize(path)` collect a run's status, attempts, last metrics and
checkpoints; `verify_run(path)` checks every checkpoint's files against its commit marker,
with full hashes. Nothing here writes to storage: unlike a driver that resumes a run, an
inspection never deletes uncommitted leftovers or sets torn checkpoints aside.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from unbroken.errors import RunNotFoundError, TornCheckpointError, UnbrokenError
from unbroken.run import checkpoint_advice, goodput
from unbroken.run.restore import PARAMS_JSON
from unbroken.store import commit, history, validation_record
from unbroken.store import manifest as mf
from unbroken.store import sweep_manifest as sweep
from unbroken.store.lease import live_holder
from unbroken.store.storage import Storage, split_run_url

# Checkpoint states.
COMMITTED = "committed"      # the marker reads and the files match it (as far as checked)
TORN = "torn"                # no readable marker, or a file is missing or has the wrong size
CORRUPTED = "corrupted"      # every file is there with its size, but a hash does not match
UNCOMMITTED = "uncommitted"  # a staging or half-deleted directory: never a checkpoint
QUARANTINED = "quarantined"  # set aside by an earlier resume as <name>.corrupt-N

_QUARANTINED = re.compile(r"^[^.].*\.corrupt-\d+$")
_ANY_CHECKPOINT = re.compile(r"^checkpoint_(\d{6,})")
ABORTED_NOTE = "the driver stopped without recording an end (killed?)"


@dataclass
class CheckpointState:
    """One checkpoint directory (or leftover) and what checking it found."""

    name: str
    state: str
    iteration: int | None = None
    attempt: int | None = None
    files: int | None = None
    bytes: int | None = None
    committed_at: float | None = None
    problems: list[str] = field(default_factory=list)
    # Its validation: None (none asked for), PENDING_VALIDATION, VALIDATED, VALIDATION_FAILED or
    # VALIDATION_TIMEOUT, with what it returned, or its error.
    validation: str | None = None
    validation_metrics: dict[str, Any] = field(default_factory=dict)
    validation_error: str = ""

    @property
    def is_checkpoint(self) -> bool:
        """A `checkpoint_NNNNNN` directory (committed or damaged), not a leftover or quarantined one."""
        return self.state in (COMMITTED, TORN, CORRUPTED)


@dataclass
class RunSummary:
    """What one run directory says about the run. `status` is the recorded status, except
    that a RUNNING run whose driver is gone shows as ABORTED."""

    name: str
    path: str
    status: str
    recorded_status: str | None = None
    trainer_class: str | None = None
    run_id: str | None = None
    created_at: float | None = None
    updated_at: float | None = None
    attempts: list[dict[str, Any]] = field(default_factory=list)
    iteration: int | None = None
    last_metrics: dict[str, Any] | None = None
    latest_checkpoint: str | None = None
    checkpoints: list[CheckpointState] | None = None  # None in brief summaries
    params: dict[str, Any] = field(default_factory=dict)
    pickled_params: list[str] = field(default_factory=list)
    config: Any = None
    driver: dict[str, Any] | None = None
    problem: str | None = None
    kind: str = "run"  # or "sweep": then `trials` counts its trials by status
    trials: dict[str, int] | None = None
    time: dict[str, Any] | None = None  # where the run's time went: run.goodput.Goodput.to_json()

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class VerifyReport:
    """Every checkpoint of one run, checked with full hashes."""

    path: str
    checkpoints: list[CheckpointState]

    @property
    def bad(self) -> list[CheckpointState]:
        return [c for c in self.checkpoints if c.state in (TORN, CORRUPTED)]

    @property
    def ok(self) -> bool:
        return not self.bad

    @property
    def resume_point(self) -> str | None:
        """The checkpoint a resume would start from: the newest one that verifies."""
        good = [c for c in self.checkpoints if c.state == COMMITTED]
        return good[-1].name if good else None

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "ok": self.ok, "resume_point": self.resume_point,
                "checkpoints": [dataclasses.asdict(c) for c in self.checkpoints]}


# -- runs ---------------------------------------------------------------------------------
def list_runs(root: str, storage_filesystem: Any = None) -> list[RunSummary]:
    """A brief summary of every run directly under `root` (or of `root` itself if it is a run).

    Directories that are not runs are skipped; a run whose manifest cannot be read is listed
    with status UNREADABLE and the reason.
    """
    storage = Storage.from_url(root, storage_filesystem)
    if not storage.exists():
        raise RunNotFoundError(f"no storage at {storage.url()!r}: the path does not exist. Hint: pass "
                               "the storage_path your runs use, or set UNBROKEN_STORAGE")
    if not storage.isdir():
        raise RunNotFoundError(f"{storage.url()!r} is a file, not a storage directory. Hint: pass the "
                               "directory that holds your runs (RunConfig.storage_path)")
    if mf.is_run_dir(storage):
        return [summarize(storage.url(), storage_filesystem, brief=True)]
    runs = []
    for name in storage.listdir():
        child = storage.child(name)
        if not name.startswith(".") and sweep.is_sweep_dir(child):
            runs.append(_sweep_summary(child, storage_filesystem))
            continue
        if name.startswith(".") or not mf.is_run_dir(child):
            continue  # a file, or a directory that is neither a run nor a sweep
        try:
            runs.append(summarize(child.url(), storage_filesystem, brief=True))
        except (UnbrokenError, OSError, ValueError) as e:
            runs.append(RunSummary(name=name, path=child.url(), status="UNREADABLE", problem=str(e)))
    return runs


def _sweep_summary(storage: Storage, storage_filesystem: Any) -> RunSummary:
    """A sweep as one listing row (`unbroken ls <sweep>` lists its trials)."""
    try:
        info = sweep.summarize(storage.url(), storage_filesystem)
    except (UnbrokenError, OSError, ValueError) as e:
        return RunSummary(name=run_name(storage), path=storage.url(), status="UNREADABLE", problem=str(e),
                          kind="sweep")
    status, counts = info["status"], dict(info["counts"])
    if status == mf.RUNNING and live_holder(storage) is None:
        # Its driver is gone: as for a run, RUNNING is what it was doing when it died, and so
        # were its RUNNING trials (their processes die with it).
        status = mf.ABORTED
        aborted = counts.pop(mf.RUNNING, 0)
        if aborted:
            counts[mf.ABORTED] = counts.get(mf.ABORTED, 0) + aborted
    return RunSummary(name=info["name"], path=info["path"], status=status,
                      recorded_status=info["status"], updated_at=info["updated_at"], kind="sweep",
                      trials=counts)


def summarize(path: str, storage_filesystem: Any = None, brief: bool = False,
              mtbf_s: float | None = None) -> RunSummary:
    """Status, attempts, last metrics, checkpoints, arguments and time spent of the run at
    `path`, with the checkpoint interval advised for `mtbf_s` (default: the run's own).

    `brief` (for listings) finds the latest readable checkpoint instead of checking each
    one. Checkpoint files are checked by size only; `verify_run` checks hashes.
    """
    storage = Storage.from_url(path, storage_filesystem)
    manifest = mf.load(storage)
    driver = live_holder(storage) if manifest.status == mf.RUNNING else None
    status = mf.ABORTED if manifest.status == mf.RUNNING and driver is None else manifest.status
    attempts = []
    for a in manifest.attempts:
        entry = dataclasses.asdict(a)
        if a.status == mf.RUNNING and driver is None:
            entry.update(status=mf.ABORTED, error=a.error or ABORTED_NOTE)
        attempts.append(entry)
    last = history.last_row(storage)
    summary = RunSummary(
        name=run_name(storage), path=storage.url(), status=status, recorded_status=manifest.status,
        trainer_class=manifest.trainer_class, run_id=manifest.run_id, created_at=manifest.created_at,
        updated_at=manifest.updated_at, attempts=attempts,
        iteration=last.get("training_iteration") if last else None, last_metrics=last,
        params=manifest.params, pickled_params=manifest.pickled_params,
        config=manifest.identity["train_loop_config"] if "train_loop_config" in manifest.identity
        else _read_json(storage, PARAMS_JSON),
        driver=driver, time=_time(attempts, history.read_rows(storage), mtbf_s))
    if brief:
        names, _ = commit.scan(storage)
        for name in reversed(names):
            try:
                commit.read_marker(storage, name)
            except TornCheckpointError:
                continue
            summary.latest_checkpoint = name
            break
    else:
        summary.checkpoints = checkpoint_states(storage, hashes=False)
        committed = [c.name for c in summary.checkpoints if c.state == COMMITTED]
        summary.latest_checkpoint = committed[-1] if committed else None
    return summary


def _time(attempts: list[dict[str, Any]], rows: list[dict[str, Any]], mtbf_s: float | None) -> dict[str, Any]:
    """Where the run's time went, and the checkpoint interval advised (None before a save)."""
    spent = goodput.of_run(attempts, rows)
    advice = checkpoint_advice.advise(attempts, rows, spent, mtbf_s)
    out = spent.to_json()
    out["advice"] = None if advice is None else {
        **dataclasses.asdict(advice), "expected_now": advice.expected(advice.interval_s or 0.0),
        "expected_advised": advice.expected(advice.advised_s)}
    return out


def run_name(storage: Storage) -> str:
    """The run's name: its directory's (what `<storage_path>/<name>` and `ls` show)."""
    return split_run_url(storage.root)[1]


def _read_json(storage: Storage, rel: str) -> Any:
    try:
        return json.loads(storage.read_bytes(rel))
    except (FileNotFoundError, ValueError):
        return None


# -- checkpoints --------------------------------------------------------------------------
def checkpoint_states(storage: Storage, hashes: bool,
                      progress: Callable[[int, int], None] | None = None) -> list[CheckpointState]:
    """Every checkpoint, leftover and quarantined directory of a run, oldest first.

    Checkpoints are checked against their markers: sizes always, CRC32 hashes when `hashes`.
    `progress(done_bytes, total_bytes)` is called while hashing.
    """
    names, leftovers = commit.scan(storage)
    markers: dict[str, commit.Marker | TornCheckpointError] = {}
    for name in names:
        try:
            markers[name] = commit.read_marker(storage, name)
        except TornCheckpointError as e:
            markers[name] = e
    total = sum(m.total_bytes for m in markers.values() if isinstance(m, commit.Marker)) if hashes else 0
    done = [0]

    def advance(n: int) -> None:
        done[0] += n
        if progress is not None:
            progress(done[0], total)

    states = [_check(storage, name, markers[name], hashes, advance) for name in names]
    states += [CheckpointState(n, UNCOMMITTED, iteration=_iteration(n)) for n in leftovers]
    states += [CheckpointState(n, QUARANTINED, iteration=_iteration(n))
               for n in storage.listdir() if _QUARANTINED.match(n)]
    states.sort(key=lambda c: (c.iteration or 0, c.name))
    return states


def verify_run(path: str, storage_filesystem: Any = None,
               progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Check every checkpoint of the run at `path` against its marker, hashing every file."""
    storage = Storage.from_url(path, storage_filesystem)
    mf.load(storage)  # a clear error when `path` is not a run
    return VerifyReport(storage.url(), checkpoint_states(storage, hashes=True, progress=progress))


def _iteration(name: str) -> int | None:
    m = _ANY_CHECKPOINT.match(name)
    return int(m.group(1)) if m else None


def _check(storage: Storage, name: str, marker: commit.Marker | TornCheckpointError, hashes: bool,
           advance: Callable[[int], None]) -> CheckpointState:
    if isinstance(marker, TornCheckpointError):
        reason = str(marker).removeprefix(f"{name}: ")
        return CheckpointState(name, TORN, iteration=_iteration(name), problems=[reason])
    state = CheckpointState(name, COMMITTED, iteration=marker.iteration, attempt=marker.attempt,
                            files=len(marker.files), bytes=marker.total_bytes,
                            committed_at=marker.committed_at)
    if marker.validation is not None:
        record = validation_record.read(storage, name)
        state.validation = validation_record.status(marker, record)
        if record is not None:
            state.validation_metrics, state.validation_error = record.metrics, record.error
    for f in marker.files:
        rel = f"{name}/{f.path}"
        try:
            size = storage.size(rel)
        except FileNotFoundError:
            state.state = TORN
            state.problems.append(f"file {f.path!r} is missing")
            advance(f.size)
            continue
        if size != f.size:
            state.state = TORN
            state.problems.append(f"file {f.path!r} has {size} bytes, the marker says {f.size}")
            advance(f.size)
            continue
        if hashes and storage.crc32(rel, advance) != f.crc32:
            if state.state == COMMITTED:
                state.state = CORRUPTED
            state.problems.append(f"file {f.path!r} does not match its hash")
    return state
