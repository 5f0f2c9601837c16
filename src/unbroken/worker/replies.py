"""The driver's replies to a rank's reports, as the rank's session takes them.

The driver answers report N once every rank has reported N (`protocol.Reply`), with the
same decisions for every rank: checkpoint at the next report, stop, which checkpoint the
round committed. A rank takes the reply to report N before its report N+1, or right after
report N when it needs the verdict at once (`Replies.wanted_now`); a stop reaches the
training loop as `StopTraining`.
"""

from __future__ import annotations

from unbroken.worker.protocol import Reply

NO_REPLY = Reply()


class StopTraining(BaseException):
    """Raised inside a worker's loop at a report when the driver stops the run.

    A BaseException so that a user's `except Exception` does not swallow it. `attach`: the
    report was made `at_end` and the driver asks for its checkpoint after all
    (`Session.attach`).
    """

    def __init__(self, attach: bool = False) -> None:
        super().__init__()
        self.attach = attach


class Replies:
    """The reply to this rank's latest report: awaited from the report's send until it is
    taken, then kept, with what it decided, until the next report."""

    def __init__(self) -> None:
        self.awaiting = False  # a report was sent and its reply is not taken yet
        self.latest = NO_REPLY  # the latest reply taken (NO_REPLY between a report and its reply)
        self._verdict_at: int | None = None  # from the latest reply taken (Reply.verdict_at)
        self.preemption: dict | None = None  # the first reply's that had one (Reply.preemption)

    def sent(self) -> None:
        """A report was sent: its reply is awaited, and the previous one decides nothing more."""
        self.awaiting = True
        self.latest = NO_REPLY

    def took(self, reply: Reply) -> None:
        """`reply`, to the report awaiting it, was taken."""
        self.latest, self._verdict_at = reply, reply.verdict_at
        if self.preemption is None:
            self.preemption = reply.preemption
        self.awaiting = False

    def wanted_now(self, iteration: int, at_end: bool) -> bool:
        """Whether report `iteration` is to take its reply as soon as it is sent: the driver
        asked for its checkpoint (preemption), or it may be the last report (`at_end`, or at
        or after the iteration the stop verdict is due), so that a stop ends the loop right
        after it instead of after one more iteration."""
        return (self.latest.checkpoint or at_end
                or (self._verdict_at is not None and iteration >= self._verdict_at))

    def stop_if_told(self) -> None:
        """Raise StopTraining when the latest reply taken stops the run."""
        if self.latest.stop:
            raise StopTraining(self.latest.attach)
