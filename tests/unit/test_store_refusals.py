"""A store that refuses writes (full, read-only, not ours) is one line and not retried, whether the
refusal is met by the store's own writes, by a writer in its staging directory, or by a DCP rank."""

from __future__ import annotations

import errno
import traceback
from pathlib import Path

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from spotrun.trainer.errors import StorageError, TransientStorageError
from spotrun.trainer.saving.publish import refused
from spotrun.trainer.saving.sharded import Failed
from spotrun.trainer.storage import LocalStorage


def _dcp(exc: BaseException) -> CheckpointException:
    return CheckpointException("save failed", {1: (exc, traceback.StackSummary())})


CASES: list[tuple[str, BaseException, str | None]] = [
    # (id, what the writer met, what the one line says; None: not a refusal, passed as it is)
    ("full", OSError(errno.ENOSPC, "No space left on device"), "no space left"),
    ("read-only", OSError(errno.EROFS, "Read-only file system"), "read-only"),
    ("not ours", PermissionError(errno.EACCES, "Permission denied"), "permission denied"),
    ("an I/O error is not a refusal", OSError(errno.EIO, "Input/output error"), None),
    ("a rank's full disk inside DCP", _dcp(OSError(errno.ENOSPC, "No space left")), "no space left"),
    ("a rank's crash inside DCP", _dcp(RuntimeError("boom")), None),
    ("the store's own refusal", StorageError("bucket b: access denied"), "access denied"),
    ("unreachable is retried", TransientStorageError("endpoint down"), None),
    ("not storage at all", ValueError("bad"), None),
]


@pytest.mark.parametrize(("met", "says"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refusals(tmp_path: Path, met: BaseException, says: str | None) -> None:
    storage = LocalStorage(tmp_path / "store")
    mapped = refused(met, storage)
    failed = Failed.of(1, met, storage)
    if says is None:
        assert mapped is None and not failed.refused
        assert failed.why.startswith(f"rank 1: {type(met).__name__}: ")
        return
    assert isinstance(mapped, StorageError) and not isinstance(mapped, TransientStorageError)
    assert says in str(mapped).lower(), mapped
    assert failed.refused and failed.why == f"rank 1: {mapped}" and "\n" not in failed.why
    if isinstance(met, OSError):
        assert f"cannot write a checkpoint in storage {storage.uri}" in str(mapped)
