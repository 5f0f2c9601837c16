"""The controller's states: one small immutable object per state, carrying that state's data.

A controller (`unbroken.execution.controller`) is in exactly one of these at a time and moves
between them only through `Controller._transition`, which checks each move with
`check_transition`; its loop runs the step of the state it is in (`Controller.STEPS`) until
one is terminal. Modelled on Ray Train V2's `controller/state.py`. The moves:

- Starting -> Running -> Finished: an attempt starts its workers, which run to the end (also
  from Stopping, when they end before the checkpoint asked for).
- Running -> Stopping -> Interrupted: a first SIGINT, or a preemption notice for the driver's
  machine (a SIGTERM, a spot notice), asks the workers for a checkpoint, then stops them (a
  second signal stops them at once, from Running or Stopping); near a notice's deadline they
  give their step up, and the last report round is saved just in time (Stopping ->
  Interrupted through the failure).
- Running -> Stopping -> Preempted -> Starting: a notice for some ranks' nodes (a Ray drain):
  the same checkpoint and stop (or the failure near the deadline), and the next attempt
  runs without those nodes.
- Running -> Stopping -> Resizing -> Starting: an elastic run can grow; the workers checkpoint
  at their next report and stop, and the next attempt starts larger (not a failure).
- Starting, Running or Stopping -> Restarting -> Starting: a failure the policy retries.
- Starting, Running or Stopping -> Errored: a failure the policy gives up on.
- Starting or Restarting -> Interrupted: a signal seen between attempts.

Finished, Interrupted and Errored are terminal (`is_terminal`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar

from unbroken.execution.notices import Notice

if TYPE_CHECKING:
    from unbroken.execution.engine.base import WorkerGroup


@dataclass(frozen=True)
class ControllerState:
    """Base of the controller's states; `name`: the state's name, for logs and messages."""

    name: ClassVar[str] = "?"

    def is_terminal(self) -> bool:
        """True when the run ended (finished, interrupted or errored): nothing follows."""
        return False


@dataclass(frozen=True)
class Starting(ControllerState):
    """Attempt `attempt` (its number in the run) is beginning: its worker group is being made
    and started. Also the state of a controller that has not run an attempt yet."""

    name: ClassVar[str] = "STARTING"
    attempt: int


@dataclass(frozen=True)
class Running(ControllerState):
    """The ranks of attempt `attempt` are running their training loop on `group` (its worker
    group); the controller records their report rounds."""

    name: ClassVar[str] = "RUNNING"
    attempt: int
    group: WorkerGroup | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Stopping(ControllerState):
    """Preemption: a notice (`notice`, see `unbroken.execution.notices`; `signal`: the
    SIGTERM/SIGINT to the driver that gave it, if one did) came during attempt `attempt`; the
    workers are asked for a checkpoint, then told to stop. Or an elastic resize (`resize_to`
    workers, no notice): the same checkpoint and stop.

    `asked_at`: the round whose reply asked for the checkpoint (None until a round completed);
    `stopped`: a later round's reply told the workers to stop, so the attempt ends PREEMPTED
    (RESIZED for a resize); `abandoned`: the ranks were told to give their step up, the
    notice's deadline being near (`Notice.abandon_at`).
    """

    name: ClassVar[str] = "STOPPING"
    attempt: int
    signal: str | None
    asked_at: int | None = None
    stopped: bool = False
    resize_to: int | None = None
    notice: Notice | None = None
    abandoned: bool = False

    def asking_at(self, iteration: int) -> Stopping:
        """This state once round `iteration`'s reply asked the workers for a checkpoint."""
        return replace(self, asked_at=iteration)

    def stopping_workers(self) -> Stopping:
        """This state once a round's reply told the workers to stop."""
        return replace(self, stopped=True)


@dataclass(frozen=True)
class Restarting(ControllerState):
    """Attempt `attempt` failed with `error` and the failure policy retries it: the next
    attempt starts from the latest committed checkpoint."""

    name: ClassVar[str] = "RESTARTING"
    attempt: int
    error: Exception


@dataclass(frozen=True)
class Resizing(ControllerState):
    """Attempt `attempt` of an elastic run stopped at a checkpoint so that the next one runs on
    `to` workers: a resize, not a failure."""

    name: ClassVar[str] = "RESIZING"
    attempt: int
    to: int


@dataclass(frozen=True)
class Preempted(ControllerState):
    """Attempt `attempt` stopped for `notice`, which named some of its ranks' nodes (a Ray
    drain): not a failure; the next attempt starts without those nodes."""

    name: ClassVar[str] = "PREEMPTED"
    attempt: int
    notice: Notice


@dataclass(frozen=True)
class Finished(ControllerState):
    """The training loop returned on every rank; the run is FINISHED."""

    name: ClassVar[str] = "FINISHED"

    def is_terminal(self) -> bool:
        return True


@dataclass(frozen=True)
class Interrupted(ControllerState):
    """`signal` stopped the run (after the checkpoint it asked for, or at once on a second
    signal, or between attempts); the run is INTERRUPTED and can be restored."""

    name: ClassVar[str] = "INTERRUPTED"
    signal: str | None

    def is_terminal(self) -> bool:
        return True


@dataclass(frozen=True)
class Errored(ControllerState):
    """The failure policy gave up on `error` (or `error` was not an Exception, e.g. a
    KeyboardInterrupt outside the signal handlers); fit() raises."""

    name: ClassVar[str] = "ERRORED"
    error: BaseException

    def is_terminal(self) -> bool:
        return True


def notice_of(state: ControllerState) -> Notice | None:
    """The preemption notice the controller is stopping for, if it is (see `Stopping`)."""
    return state.notice if isinstance(state, Stopping) else None


# The states each state may move to. Starting -> Starting: a new controller is already
# Starting when its first attempt begins; Stopping -> Stopping: its round data changes.
_NEXT: dict[type[ControllerState], tuple[type[ControllerState], ...]] = {
    Starting: (Starting, Running, Restarting, Errored, Interrupted),
    Running: (Stopping, Finished, Restarting, Errored, Interrupted),
    Stopping: (Stopping, Finished, Restarting, Errored, Interrupted, Resizing, Preempted),
    Restarting: (Starting, Interrupted),
    Preempted: (Starting, Interrupted),
    Resizing: (Starting, Interrupted),
    Finished: (),
    Interrupted: (),
    Errored: (),
}


class IllegalTransitionError(RuntimeError):
    """A controller tried a state change that the controller's design rules out (a bug)."""


def check_transition(old: ControllerState, new: ControllerState) -> None:
    """Raise IllegalTransitionError unless a controller in `old` may move to `new`."""
    if type(new) not in _NEXT.get(type(old), ()):
        raise IllegalTransitionError(f"the controller cannot go from {old!r} to {new!r}")
