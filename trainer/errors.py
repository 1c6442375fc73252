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
