"""Exception types. Each says whether retrying can help: the flow and the storage layer act on that."""

from __future__ import annotations


class SpotrunError(Exception):
    """Base class for every error spotrun raises on purpose."""


class ConfigError(SpotrunError):
    """A job spec, recipe or argument is wrong. Retrying cannot help; the message says what to fix."""


class ResumeIncompatible(SpotrunError):
    """A checkpoint was made by a job whose shape-relevant settings differ from this one."""


class StorageError(SpotrunError):
    """A storage operation failed for a reason that retrying will not fix (missing bucket, denied)."""


class TransientStorageError(StorageError):
    """A storage operation failed in a way that is safe to retry (throttling, 5xx, connection reset)."""


class CheckpointError(SpotrunError):
    """Writing, uploading or verifying a checkpoint failed; training must not go on as if it were saved."""


class TrainingDiverged(SpotrunError):
    """The loss became NaN or infinite."""


class PreconditionFailed(StorageError):
    """A conditional write found the object changed (or present, or absent) since it was read.

    Not a failure to retry as is: the caller re-reads the object and decides again."""


class LeaseHeld(SpotrunError):
    """Another live trainer holds the job's storage lease; the message names it and when it expires."""


class LeaseLost(SpotrunError):
    """This trainer no longer holds the storage lease: it must publish nothing more.

    `taken_by` names the worker that took it over, or is None when the lease merely ran out without
    a renewal (storage unreachable for a whole TTL): then nobody else is known to be writing."""

    def __init__(self, message: str, taken_by: str | None = None) -> None:
        super().__init__(message)
        self.taken_by = taken_by
