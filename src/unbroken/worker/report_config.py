"""The options of `train.report` that Ray Train V2 added, with unbroken's meaning for each:
`CheckpointUploadMode`, `CheckpointConsistencyMode`, `ReportedCheckpoint` with its
`ReportedCheckpointStatus`, and the check
that turns a V2 option unbroken does not support into an error that says what to do instead.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from unbroken.errors import UnsupportedOptionError
from unbroken.store.checkpoint import Checkpoint


class CheckpointUploadMode(enum.Enum):
    """How `train.report` hands a checkpoint's files to storage (Ray Train V2).

    SYNC: the report copies this rank's files into the run's staging area (fsynced) and then
    returns; the driver commits the checkpoint once every rank has reported.
    ASYNC: the report returns at once; this rank's files are copied into the staging area in
    the background, and the driver commits the checkpoint once every rank's copy is durable
    (`unbroken.worker.async_save`). The directory must stay as it is until the next checkpoint
    report; with `delete_local_checkpoint_after_upload` (its default for ASYNC, as in Ray)
    it is moved aside at once, so the caller may delete or reuse the path.
    NO_UPLOAD: refused. unbroken stages and commits every checkpoint itself; a checkpoint
    that is already somewhere on storage cannot be committed atomically into the run.
    """

    SYNC = "SYNC"
    ASYNC = "ASYNC"
    NO_UPLOAD = "NO_UPLOAD"

    def default_delete_local_checkpoint_after_upload(self) -> bool:
        """What `delete_local_checkpoint_after_upload=None` means: True for ASYNC only."""
        return self is CheckpointUploadMode.ASYNC


def upload_mode(mode: CheckpointUploadMode | str, where: str) -> CheckpointUploadMode:
    """`mode` (a CheckpointUploadMode or its name) as `where` takes it: SYNC or ASYNC;
    UnsupportedOptionError for NO_UPLOAD, TypeError for anything else, each with a hint."""
    known = CheckpointUploadMode.__members__.get(mode) if isinstance(mode, str) else mode
    if not isinstance(known, CheckpointUploadMode):
        raise TypeError(f"{where}(checkpoint_upload_mode=...) takes a CheckpointUploadMode (SYNC or ASYNC), "
                        f"got {mode!r}. Hint: CheckpointUploadMode.ASYNC saves in the background")
    if known is CheckpointUploadMode.NO_UPLOAD:
        raise UnsupportedOptionError(
            f"{where}(checkpoint_upload_mode=NO_UPLOAD) is not supported: unbroken copies each rank's "
            "checkpoint files into the run directory itself, so that the checkpoint commits "
            "atomically. Hint: use CheckpointUploadMode.SYNC (or ASYNC)")
    return known


def upload_is_async(mode: CheckpointUploadMode | str, where: str) -> bool:
    """Whether `mode` (checked by `upload_mode`) writes the checkpoint in the background."""
    return upload_mode(mode, where) is CheckpointUploadMode.ASYNC


class CheckpointConsistencyMode(enum.Enum):
    """What `get_all_reported_checkpoints` waits for (Ray Train V2): COMMITTED, until the
    checkpoint of this rank's latest report is committed (or known not to exist); VALIDATED,
    also until every validation asked for so far has ended."""

    COMMITTED = "COMMITTED"
    VALIDATED = "VALIDATED"


class ReportedCheckpointStatus(enum.Enum):
    """Where a reported checkpoint stands (Ray Train V2): COMMITTED (no validation asked
    for), PENDING_VALIDATION, VALIDATED (its metrics include what the validation returned),
    VALIDATION_FAILED (the function raised; see `unbroken show`), VALIDATION_TIMEOUT."""

    COMMITTED = "COMMITTED"
    PENDING_VALIDATION = "PENDING_VALIDATION"
    VALIDATED = "VALIDATED"
    VALIDATION_TIMEOUT = "VALIDATION_TIMEOUT"
    VALIDATION_FAILED = "VALIDATION_FAILED"


@dataclass(frozen=True)
class ReportedCheckpoint:
    """A committed checkpoint of the run and the metric row of the report that carried it
    (rank 0's metrics plus `training_iteration`, `attempt`, ... as in `Result.best_checkpoints`),
    with what its validation returned over it once VALIDATED."""

    checkpoint: Checkpoint
    metrics: dict[str, Any]
    status: ReportedCheckpointStatus = ReportedCheckpointStatus.COMMITTED


def delete_after_upload(mode: Any, delete_local: bool | None, upload_fn: Any,
                        validate_fn: Any, validate_config: Any) -> bool:
    """Check `train.report`'s V2 options; returns whether to delete the local checkpoint
    directory once its files are staged. UnsupportedOptionError for what unbroken cannot do."""
    mode = upload_mode(mode, "train.report")
    if upload_fn is not None:
        raise UnsupportedOptionError(
            "train.report(checkpoint_upload_fn=...) is not supported: unbroken uploads each rank's "
            "files itself and writes the commit marker last, which a custom upload would bypass. "
            "Hint: drop checkpoint_upload_fn; RunConfig(storage_path='s3://...') uploads to any "
            "fsspec storage")
    if validate_fn is not None or validate_config is not None:
        raise UnsupportedOptionError(
            "train.report(validate_fn=... / validate_config=...) is an older Ray spelling that Ray "
            "2.60 no longer takes. Hint: pass validation_config=ValidationConfig(fn=...) to the "
            "trainer and train.report(..., validation=True) (or a ValidationTaskConfig)")
    if delete_local is None:
        return mode.default_delete_local_checkpoint_after_upload()
    return bool(delete_local)
