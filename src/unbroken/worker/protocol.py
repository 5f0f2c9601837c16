"""The messages between the driver and its workers, and between a sweep driver and its trials.

Small records (treat them as immutable), the same on every engine. A worker sends
`Report`s, rank 0 one `Rendezvous` during set-up, a `Staged` when the files of an
asynchronous save are durable, a `Terminating` when its process is told to end, and ends with
`Done` or `Failed`; the driver answers every complete round with a `Reply`, forwards rank
0's `Rendezvous` to the other ranks, and says `Committed` when an asynchronous save is
committed (see `async_save`) and `Validated` when a checkpoint's validation is recorded
(see `validations`). With just-in-time
checkpoints a rank says `JitArmed` once, a failing rank sends `JitOffer` before its `Failed`
and waits for the driver's `JitSave`, and the chosen rank answers with `JitSaved` (see
`recovery.messages`); when the run recovers in place, the driver answers `Stay` instead, and
later sends the rank its next attempt as a `Rejoin`. A collective call
with no process group under it (`train.collective`) is a `Gather` from every rank,
answered with one `Gathered` to each. A trial's process ends with `TrialDone`,
`TrialInterrupted` or `TrialFailed`. How a message travels (a pipe, a socket) is the
engine's business; what it means is here, and `to_wire` / `from_wire` give an engine a
cheap form to send.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from unbroken.store.commit import FileEntry
from unbroken.worker.recovery.messages import JitArmed, JitOffer, JitSave, JitSaved, Rejoin, Stay


@dataclass(slots=True)
class Report:
    """A rank's report N: its metrics, the files it staged for checkpoint N (if any), and
    the checkpoint directory name it gave with them (None: the default name). `pending`: this
    rank's files for checkpoint N are being written in the background; a `Staged` follows.
    `validation`: the validation it asks for on checkpoint N (see `validation_config`).
    `save_s`: how long this report blocked the rank's loop saving checkpoint N (the row's
    `time_checkpoint_s`, a run's checkpoint stall). `auto`: the loop saves when the driver
    asks (`TrainState.report(..., checkpoint="auto")`; see `checkpoint_cadence`). `forward_s`:
    the seconds this rank spent in its model's forward passes since its previous report (None
    when unmeasured; see `forward_clock`). `at_end`: with no files attached, this rank can
    still save checkpoint N should the round's verdict end the run (a class trainable's
    `checkpoint_at_end`): it waits for the reply, and the driver may answer `attach`."""

    iteration: int
    metrics: dict[str, Any]
    files: list[FileEntry] | None = None
    name: str | None = None
    pending: bool = False
    validation: dict[str, Any] | None = None
    save_s: float = 0.0
    auto: bool = False
    forward_s: float | None = None
    at_end: bool = False


@dataclass(slots=True)
class Reply:
    """The driver's answer to a complete round, the same for every rank: stop at the next
    report, and/or checkpoint at it (a preemption); `committed`: the name of the checkpoint
    this round committed, if it did (`train.get_checkpoint()` follows it); `verdict_at`: the
    first iteration whose report `RunConfig.stop` may stop at, where it can say
    (`config.stop_due_at`): a rank waits for the verdict right after that report and the
    ones after it, instead of running one more iteration before it learns it stops.
    `attach`: with `stop`, to ranks that reported `at_end`: save checkpoint N of the round
    just reported after all, and send its files as a `Staged(N)` before ending.
    `preemption`: once the driver has a preemption notice, what `train.get_preemption_info()`
    says from this round on ({"deadline_ms", "preempted_node_to_ranks"}), on every rank alike."""

    stop: bool = False
    checkpoint: bool = False
    committed: str | None = None
    verdict_at: int | None = None
    attach: bool = False
    preemption: dict[str, Any] | None = None


@dataclass(slots=True)
class Rendezvous:
    """A value rank 0 shares with every rank during set-up (e.g. the process group's port)."""

    value: Any


@dataclass(slots=True)
class Done:
    """The worker's loop ended normally after `reports` reports."""

    reports: int


@dataclass(slots=True)
class Failed:
    """The worker's loop raised: the traceback text, the cloudpickled exception (None when
    it does not pickle), and when (wall clock) the rank failed: the driver orders by it the
    failures of several ranks that reach it together (`worker_failures.record`)."""

    traceback: str
    error: bytes | None = None
    at: float = 0.0


@dataclass(slots=True)
class Staged:
    """The files of this rank's asynchronous save for checkpoint `iteration` are durable in
    the staging area (sent after its `Report`, before any later `Staged` of this rank)."""

    iteration: int
    files: list[FileEntry]


@dataclass(slots=True)
class Committed:
    """The driver committed the asynchronous checkpoint of report `iteration`, as `name`."""

    iteration: int
    name: str


@dataclass(slots=True)
class Validated:
    """The validation of checkpoint `name` ended and is recorded (see `validation_record`)."""

    name: str


@dataclass(slots=True)
class Gather:
    """This rank's part of collective call number `seq` of the attempt (every rank counts its
    calls the same way): `op` names the call; `data` is what it contributes, pickled (None:
    nothing), or `error` says why it cannot contribute."""

    seq: int
    op: str
    data: bytes | None = None
    error: str = ""


@dataclass(slots=True)
class Gathered:
    """The driver's answer to collective call `seq` once every rank made it: rank 0's `data`,
    or why there is none: a rank's `error`, or the `mismatch` between the ranks' calls."""

    seq: int
    data: bytes | None = None
    error: str = ""
    mismatch: str = ""


@dataclass(slots=True)
class Terminating:
    """A rank was told its process ends soon (a SIGTERM to a local worker process, `at`:
    time.time()): a preemption notice for the driver (see `execution.notices`)."""

    source: str
    at: float


WorkerMessage = Union[Report, Rendezvous, Staged, JitArmed, JitOffer, JitSaved, Gather, Terminating, Done,
                      Failed]
Outcome = Union[Done, Failed]


@dataclass(slots=True)
class TrialPlaced:
    """A trial's driver actor started on a node of the Ray cluster (before its outcome)."""

    node_id: str
    address: str
    pid: int


@dataclass(slots=True)
class TrialTaken:
    """A trial's process kept from an earlier trial (`reuse_actors`) took the trial it was
    given, and begins it now (before its outcome)."""


@dataclass(slots=True)
class TrialDone:
    """A trial's run ended with this run status (FINISHED, or ERRORED within the run)."""

    status: str


@dataclass(slots=True)
class TrialInterrupted:
    """A trial's run was interrupted by a signal; `reason` is the first line of the error."""

    reason: str


@dataclass(slots=True)
class TrialFailed:
    """A trial's process raised: the exception's type name, a one-line summary, the traceback."""

    kind: str
    summary: str
    traceback: str


TrialOutcome = Union[TrialDone, TrialInterrupted, TrialFailed]


# -- on the wire --------------------------------------------------------------------------------
_KINDS: tuple[type, ...] = (Report, Reply, Rendezvous, Done, Failed, TrialDone, TrialInterrupted,
                            TrialFailed, Staged, Committed, JitArmed, JitOffer, JitSave, JitSaved, Gather,
                            Gathered, Validated, Stay, Rejoin, Terminating)
_TAG = {kind: tag for tag, kind in enumerate(_KINDS)}


def to_wire(message: Any) -> tuple:
    """The message as a plain tuple (its kind's tag, then its fields): an engine that pickles
    messages sends this, because pickling a class reference costs more than the rest of a
    report (it imports the module by name on every dump)."""
    return (_TAG[type(message)], *map(message.__getattribute__, message.__slots__))


def from_wire(data: tuple) -> Any:
    """The message `to_wire` made `data` from."""
    return _KINDS[data[0]](*data[1:])
