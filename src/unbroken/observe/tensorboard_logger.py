"""TensorBoard event files for a run, written so that a resumed run shows one clean curve.

Each attempt writes its own event file in `<run>/tensorboard/`. The file starts with a
SessionLog START event at step `resumed_iteration + 1`, the marker TensorBoard reads as
"discard what earlier files logged at this step or later" (what `SummaryWriter(purge_step=...)`
writes). The rows an abandoned attempt logged after the checkpoint the next attempt
resumed from therefore vanish from the charts, while staying in the files.

Records are written with TensorBoard's own messages and record framing, but without its
writer thread: the hooks already run off the report path on the callback's own thread
(`Callback.run_in_background`), so a log directory on a slow or hung mount never holds up
training, and one small buffered write per report round is cheap.
"""

from __future__ import annotations

import importlib.util
import os
import time
from typing import Any

from unbroken.run.callbacks import Callback, RunInfo, numeric_metrics
from unbroken.store.checkpoint import Checkpoint

TENSORBOARD_DIR = "tensorboard"
FLUSH_EVERY_S = 2.0


class TensorBoardLoggerCallback(Callback):
    """Logs every numeric metric of every report round as a TensorBoard scalar, with
    `training_iteration` as the step; at each attempt's end, where the run's time went so
    far (`goodput`, `time/<kind>_s`: docs/guarantees.md#where-the-time-went) at its last step.

    Args:
        logdir: where the event files go. Defaults to `<run directory>/tensorboard`, which
            needs a run directory on a local (or mounted) filesystem.

    View with `tensorboard --logdir <storage_path>` (all runs) or `--logdir <run>/tensorboard`.
    Needs the `tensorboard` package (`pip install 'unbroken[tensorboard]'`).
    """

    run_in_background = True

    def __init__(self, logdir: str | os.PathLike | None = None) -> None:
        self.logdir = os.fspath(logdir) if logdir is not None else None
        self._file: Any = None
        self._records: Any = None
        self._purge_step = 1
        self._last_step = 0
        self._next_flush = 0.0

    def __getstate__(self) -> dict[str, Any]:
        return {"logdir": self.logdir}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["logdir"])

    def setup(self, run: RunInfo) -> None:
        if self.logdir is None and run.local_path is None:
            raise ValueError(f"run {run.path} is not on a local filesystem. Hint: pass "
                             "TensorBoardLoggerCallback(logdir=<a local directory>)")
        if importlib.util.find_spec("tensorboard") is None:  # imported at the first row, after workers start
            raise ImportError("TensorBoardLoggerCallback needs the tensorboard package. "
                              "Hint: pip install 'unbroken[tensorboard]'")

    def on_attempt_start(self, run: RunInfo) -> None:
        self._close()
        self._purge_step = run.resumed_iteration + 1

    def on_result(self, run: RunInfo, metrics: dict[str, Any]) -> None:
        event, summary = _protos()
        if self._file is None:
            self._open(run, event)
        values = [summary.Value(tag=k, simple_value=v) for k, v in numeric_metrics(metrics).items()]
        self._last_step = int(metrics["training_iteration"])
        self._write(event(wall_time=metrics.get("timestamp", time.time()),
                          step=self._last_step, summary=summary(value=values)))
        now = time.monotonic()
        if now >= self._next_flush:
            self._file.flush()
            self._next_flush = now + FLUSH_EVERY_S

    def on_checkpoint(self, run: RunInfo, checkpoint: Checkpoint, metrics: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.flush()

    def on_attempt_end(self, run: RunInfo, status: str, error: BaseException | None) -> None:
        if self._file is not None:  # where the run's time went so far, at the attempt's last step
            event, summary = _protos()
            values = [summary.Value(tag=k, simple_value=v) for k, v in run.time_spent().scalars().items()]
            self._write(event(wall_time=time.time(), step=self._last_step, summary=summary(value=values)))
        self._close()

    def on_run_end(self, run: RunInfo, status: str) -> None:
        self._close()

    def _open(self, run: RunInfo, event: Any) -> None:
        from tensorboard.compat.proto.event_pb2 import SessionLog
        from tensorboard.summary.writer.record_writer import RecordWriter

        logdir = self.logdir or os.path.join(run.local_path or "", TENSORBOARD_DIR)
        os.makedirs(logdir, exist_ok=True)
        # TensorBoard reads a directory's event files in name order: attempt order here.
        name = f"events.out.tfevents.{run.attempt:06d}.{int(time.time()):010d}.{run.run_id[:8]}"
        self._file = open(os.path.join(logdir, name), "ab")
        self._records = RecordWriter(self._file)
        now = time.time()
        self._write(event(wall_time=now, file_version="brain.Event:2"))
        self._write(event(wall_time=now, step=self._purge_step,
                          session_log=SessionLog(status=SessionLog.START)))
        self._file.flush()
        self._next_flush = time.monotonic() + FLUSH_EVERY_S

    def _write(self, event: Any) -> None:
        self._records.write(event.SerializeToString())

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = self._records = None


_PROTOS: tuple[Any, Any] | None = None


def _protos() -> tuple[Any, Any]:
    """TensorBoard's Event and Summary messages, imported on first use."""
    global _PROTOS
    if _PROTOS is None:
        try:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
        except ImportError:
            raise ImportError("TensorBoardLoggerCallback needs the tensorboard package. "
                              "Hint: pip install 'unbroken[tensorboard]'") from None
        _PROTOS = Event, Summary
    return _PROTOS
