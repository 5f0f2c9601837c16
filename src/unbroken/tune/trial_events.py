"""What a trial's run did, besides reporting results, that the sweep callbacks are told about
(see `tune.callback`): the checkpoints it committed, the fit()s it began from a checkpoint and
the failed attempts it retried. Read from the trial's own records, past the marks its
`TrialRecord` keeps of what the callbacks were given, so that each is told once.

**Checkpoints** (`saves_seen`: [attempt, iteration] of the last one told). The trial's
history (its timeline: each iteration once, a redone row replacing the one it redoes) names
the checkpoint each round has or will have; (attempt, iteration) only grows along it. A row's
checkpoint is known committed when its commit marker reads back with the row's attempt and
iteration, or when a later checkpoint of the same attempt is known committed (an attempt
commits in round order), or when a later attempt has rows (it resumed from a committed
checkpoint at or past the row: the timeline kept no row of an earlier attempt beyond that).
The last two cover checkpoints that retention deleted before the sweep driver looked. A row
whose checkpoint never commits (its driver died first) is redone by the next attempt, which
drops it from the timeline.

**Restores and recoveries** (`restores_seen`, `recovers_seen`: attempt numbers), from the
run's run.json: the first attempt of each fit() of the run (attempts of one fit() share
`fit_started_at`) that resumed from a checkpoint is a restore; an ERRORED attempt followed by
another attempt of the same fit() is a failure its FailureConfig retried. Each is told before
the results of the attempt it concerns.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import takewhile

from unbroken.errors import TornCheckpointError, UnbrokenError
from unbroken.store import commit, history
from unbroken.store import manifest as mf
from unbroken.store import sweep_manifest as sw
from unbroken.store.storage import Storage
from unbroken.store.sweep_manifest import TrialRecord

SAVE_HOOKS = ("on_checkpoint", "on_trial_save")
ATTEMPT_HOOKS = ("on_trial_restore", "on_trial_recover")


@dataclass(frozen=True)
class AttemptEvent:
    """A restore or a recovery of a trial's run, to be told before the results of `before`."""

    hook: str     # "on_trial_restore" or "on_trial_recover"
    attempt: int  # the mark it sets: the attempt restored, or the failed attempt retried
    before: int   # the attempt whose results come after it


@dataclass(frozen=True)
class Save:
    """A committed checkpoint of a trial's run."""

    attempt: int
    iteration: int
    name: str


def attempt_events(attempts: list[mf.Attempt], restores_seen: int, recovers_seen: int) -> list[AttemptEvent]:
    """The restores and recoveries among a run's `attempts` past the marks, oldest first."""
    out: list[AttemptEvent] = []
    previous: mf.Attempt | None = None
    for a in attempts:
        first_of_fit = previous is None or a.fit_started_at != previous.fit_started_at
        if first_of_fit and a.resumed_from and a.number > restores_seen:
            out.append(AttemptEvent("on_trial_restore", a.number, a.number))
        if previous is not None and not first_of_fit and previous.status == mf.ERRORED \
                and previous.number > recovers_seen:
            out.append(AttemptEvent("on_trial_recover", previous.number, a.number))
        previous = a
    return out


def committed_saves(run: Storage, rows: list[dict], seen: list[int] | None) -> list[Save]:
    """The checkpoints the timeline `rows` names past `seen` that are known committed (see the
    module docstring), oldest first."""
    mark = tuple(seen) if seen else (0, 0)
    last_attempt = rows[-1].get("attempt") if rows else None
    confirmed: set[int] = set()  # attempts with a checkpoint known committed after the row at hand
    out: list[Save] = []
    for row in reversed(rows):
        name, attempt, it = row.get("checkpoint_dir_name"), row.get("attempt"), row.get("training_iteration")
        if not name or not isinstance(attempt, int) or not isinstance(it, int):
            continue
        if (attempt, it) <= mark:
            break
        if attempt != last_attempt or attempt in confirmed or _marker_says(run, name, attempt, it):
            confirmed.add(attempt)
            out.append(Save(attempt, it, name))
    return out[::-1]


def _marker_says(run: Storage, name: str, attempt: int, iteration: int) -> bool:
    try:
        marker = commit.read_marker(run, name)
    except (TornCheckpointError, OSError):
        return False
    return marker.iteration == iteration and marker.attempt == attempt


class TrialRuns:
    """Reads the sweep's trials' runs for these events: the running trials each time, the
    others once after they last ran (with `saves`, `attempts`: which events are wanted)."""

    def __init__(self, storage: Storage, saves: bool, attempts: bool) -> None:
        self.storage, self.saves, self.attempts = storage, saves, attempts
        self._settled: set[str] = set()  # trials read since they last ran

    def to_read(self, trials: Iterable[TrialRecord]) -> list[TrialRecord]:
        """The trials to read now, of the sweep's `trials`."""
        out = [r for r in trials if r.started_at and (r.status == sw.RUNNING or r.name not in self._settled)]
        self._settled.update(r.name for r in out if r.status != sw.RUNNING)
        return out

    def again(self, name: str) -> None:
        """The trial runs (again): read it until it stops, and once after."""
        self._settled.discard(name)

    def read(self, name: str) -> None:
        """The trial, which no longer runs, is read now: not again until it runs again."""
        self._settled.add(name)

    def attempt_events(self, record: TrialRecord) -> list[AttemptEvent]:
        if not self.attempts:
            return []
        try:
            run = mf.load(self.storage.child(record.name))
        except (UnbrokenError, OSError):
            return []  # no run yet, or one that does not load: the trial's end says so
        return attempt_events(run.attempts, record.restores_seen, record.recovers_seen)

    def new_saves(self, record: TrialRecord, upto: int | None) -> list[Save]:
        """The trial's committed checkpoints past its mark, up to iteration `upto` (the results
        told so far) when given."""
        if not self.saves:
            return []
        run = self.storage.child(record.name)
        saves = committed_saves(run, history.timeline(history.read_rows(run)), record.saves_seen)
        return list(takewhile(lambda s: upto is None or s.iteration <= upto, saves))
