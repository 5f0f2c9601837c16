"""The local directory that `train.report(checkpoint=...)` hands over as the rank's files of
the report's checkpoint: checked to be one (`check_local`), and, when it is to be deleted
once its files are staged in the background, taken over at once (`move_aside`)."""

from __future__ import annotations

import os
from typing import Any

from unbroken.store.checkpoint import Checkpoint


def check_local(checkpoint: Any) -> None:
    """TypeError unless `checkpoint` is a Checkpoint, ValueError unless it is a local one."""
    if not isinstance(checkpoint, Checkpoint):
        raise TypeError("train.report(checkpoint=...) needs a Checkpoint, e.g. "
                        "Checkpoint.from_directory(path)")
    if not checkpoint.is_local:
        raise ValueError(f"train.report needs a checkpoint in a local directory, got "
                         f"{checkpoint.path}. Hint: write the files to a temporary "
                         "directory and pass Checkpoint.from_directory(it)")


def move_aside(path: str, iteration: int) -> str:
    """Take over a reported directory that is to be deleted anyway: a rename, so that the caller
    may delete or reuse the path at once while the files are staged from the new one."""
    aside = f"{path.rstrip(os.sep)}.unbroken-save-{iteration}"
    os.rename(path, aside)
    return aside
