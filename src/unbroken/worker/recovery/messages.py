"""What the two halves of recovery say to each other (`unbroken.execution.recovery`, the
driver's; `unbroken.worker.recovery`, the worker's). They travel as the other messages of
`unbroken.worker.protocol` do, which gives each its tag.

With just-in-time checkpoints a rank says `JitArmed` once; a failing rank sends `JitOffer`
before its `Failed` and waits for the driver's `JitSave`, and the chosen rank answers with
`JitSaved` (see `just_in_time`). When the run recovers in place, the driver answers `Stay`
instead, and later sends the rank its next attempt as a `Rejoin` (see `peer_state`).
"""

from __future__ import annotations

from dataclasses import dataclass

from unbroken.store.commit import FileEntry


@dataclass(slots=True)
class JitArmed:
    """This rank's TrainState can save a just-in-time checkpoint (see `just_in_time`);
    `step_seed`: the seed of its per-step random streams."""

    step_seed: int = 0


@dataclass(slots=True)
class JitOffer:
    """This rank's loop failed; it can save checkpoint `iteration` just in time (None: it
    cannot, for `reason`). Sent before its `Failed`; the rank then waits for a `JitSave`."""

    iteration: int | None
    reason: str = ""


@dataclass(slots=True)
class JitSave:
    """The driver's word to a rank that offered: save checkpoint `iteration` (None: do not);
    `seeds`: every rank's step seed (from their `JitArmed`), for their random states."""

    iteration: int | None
    seeds: dict[int, int] | None = None


@dataclass(slots=True)
class Stay:
    """The driver's word to a rank that offered, when the run recovers in place (see
    `peer_state`): do not save and do not exit; the next attempt starts in this process (its
    payload comes as a `Rejoin`), from the state of report `iteration`, which rank `source`
    holds and sends to every rank."""

    source: int
    iteration: int


@dataclass(slots=True)
class Rejoin:
    """The next attempt's payload (a cloudpickled `WorkerPayload`) for a rank that stayed."""

    payload: bytes


@dataclass(slots=True)
class JitSaved:
    """The just-in-time checkpoint `iteration` is staged (`files`), or could not be (`error`)."""

    iteration: int
    files: list[FileEntry] | None
    error: str = ""


JIT_MESSAGES = (JitArmed, JitOffer, JitSaved)
