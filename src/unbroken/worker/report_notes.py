"""What a rank's report tells the driver about its loop besides the metrics: how long the
loop was blocked saving the report's checkpoint (`Report.save_s`), the seconds it spent in
its model's forward passes (`Report.forward_s`, see `forward_clock`), and whether its
checkpoints are left to the driver's interval (`Report.auto`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from unbroken.worker.forward_clock import ForwardClock
    from unbroken.worker.protocol import Report


class ReportNotes:
    """This rank's notes for its coming report, filled in as the loop runs."""

    def __init__(self) -> None:
        self._save_t0: float | None = None  # when the save of the coming report began
        self.auto = False  # TrainState.report(..., checkpoint="auto")
        self.forward_clock: ForwardClock | None = None  # on the model prepare_model wrapped last

    def saving(self) -> None:
        """The save of the coming report begins now, unless it began already."""
        if self._save_t0 is None:
            self._save_t0 = time.monotonic()

    def time_forward(self, clock: ForwardClock | None) -> None:
        """Take the forward seconds from `clock` from now on; the previous clock stops."""
        if self.forward_clock is not None:
            self.forward_clock.detach()
        self.forward_clock = clock

    def stamp(self, report: Report) -> None:
        """Write the notes into `report`, about to be sent, and start them again."""
        if self._save_t0 is not None:
            report.save_s = time.monotonic() - self._save_t0
            self._save_t0 = None
        report.auto = self.auto
        if self.forward_clock is not None:
            report.forward_s = self.forward_clock.take()
