"""Failure handling as a small policy: given a failure, retry the worker group or raise."""

from __future__ import annotations

import enum

from unbroken.core.config import FailureConfig
from unbroken.errors import (
    CheckpointConflictError,
    LeaseLostError,
    ReportMismatchError,
    StorageNotSharedError,
    VersionMismatchError,
)


class FailureDecision(enum.Enum):
    RETRY = "retry"
    RAISE = "raise"


# Failures that a restart would only repeat.
_NOT_RETRYABLE = (ReportMismatchError, CheckpointConflictError, LeaseLostError, StorageNotSharedError,
                  VersionMismatchError)


class FailurePolicy:
    """Counts failures within one fit() against FailureConfig.max_failures (-1: unlimited)."""

    def __init__(self, config: FailureConfig) -> None:
        self.config = config
        self.failures = 0

    def can_retry(self) -> bool:
        """Whether one more failure would be retried (a retryable one)."""
        limit = self.config.max_failures
        return not self.config.fail_fast and (limit < 0 or self.failures < limit)

    def decide(self, error: BaseException) -> FailureDecision:
        self.failures += 1
        if isinstance(error, _NOT_RETRYABLE) or self.config.fail_fast:
            return FailureDecision.RAISE
        limit = self.config.max_failures
        if limit < 0 or self.failures <= limit:
            return FailureDecision.RETRY
        return FailureDecision.RAISE
