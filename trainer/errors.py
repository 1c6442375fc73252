"""Exception types. Each says whether retrying can help: the flow and the storage layer act on that."""

from __future__ import annotations

from typing import Self

_ECHO = "echo"  # the field's name, carried as a plain attribute by an error outside this hierarchy


class SpotrunError(Exception):
    """Base class for every error spotrun raises on purpose.

    Two fields tell the process edge (trainer/__main__.py) how to log it, set through `mark`: `logged`,
    already said where it was found (the exit does not say it again); `echo`, rank 0's verdict raised on
    every rank (rank 0 says it, the others one info line). Both travel with it when it is pickled."""

    logged: bool = False
    echo: bool = False

    def mark(self, *, logged: bool | None = None, echo: bool | None = None) -> Self:
        """Set how the process edge logs this error (None: leave that field); returns it, to raise."""
        if logged is not None:
            self.logged = logged
        if echo is not None:
            self.echo = echo
        return self


def mark_echo(e: BaseException, echo: bool) -> None:
    """Mark any error as rank 0's verdict raised on this rank too (`echo`), or not."""
    if isinstance(e, SpotrunError):
        e.mark(echo=echo)
    else:  # rank 0 broadcasts whatever it caught: a foreign type has no field, so it carries the attribute
        setattr(e, _ECHO, echo)


def is_echo(e: BaseException) -> bool:
    """Whether `e` is rank 0's verdict raised on this rank too: rank 0 has logged it."""
    return e.echo if isinstance(e, SpotrunError) else bool(getattr(e, _ECHO, False))


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
