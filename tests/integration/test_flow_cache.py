"""The controller's flow cache: after each check of an S3 store (moto on 127.0.0.1) it holds only the
checkpoint found intact; a full disk during the check is an alert and a skipped check, not a crash."""

from __future__ import annotations

import errno
import hashlib
import logging
import socket
from pathlib import Path

import pytest

from spotrun.tasks.control.checkpoints import CONTROLLER_DISK_FULL, ResumePoint, check_integrity
from spotrun.tasks.control.loop import PlainSink, _check_checkpoints
from spotrun.trainer.checkpoint.format import MANIFEST, REQUIRED_FILES, FileEntry, Manifest, step_dir
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import Storage, open_storage, put_bytes

pytestmark = pytest.mark.timeout(60)


def write(store: Storage, step: int, damaged: bool = False) -> None:
    """One committed checkpoint of small files; `damaged`: a file changed after it was hashed."""
    files = {f: f"{f} of step {step}".encode() for f in REQUIRED_FILES}
    entries = {f: FileEntry(len(b), hashlib.sha256(b).hexdigest(), "sha256") for f, b in files.items()}
    if damaged:
        files["model.safetensors"] = files["model.safetensors"][::-1]
    for f, b in files.items():
        put_bytes(store, f"{step_dir(step)}/{f}", b)
    put_bytes(
        store,
        f"{step_dir(step)}/{MANIFEST}",
        Manifest(step, "spec", "shape", world_size=1, files=entries).to_json(),
    )


def cached(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def test_the_cache_keeps_only_the_checkpoint_found_intact(tmp_path: Path, s3_bucket: tuple[str, str]) -> None:
    endpoint, bucket = s3_bucket
    spec = {"name": "j", "recipe": "digits", "total_steps": 100, "storage": f"s3://{bucket}/j"}
    job = JobSpec.model_validate({**spec, "s3": {"endpoint_url": endpoint}})
    store, cache, sink = open_storage(job.storage, job.s3), tmp_path / "flow-cache", PlainSink()
    write(store, 10)
    write(store, 20, damaged=True)
    assert check_integrity(job, cache, sink).step == 10
    assert cached(cache) == [step_dir(10)]  # the damaged one's copy went with its quarantine
    write(store, 30)
    assert check_integrity(job, cache, sink).step == 30
    assert cached(cache) == [step_dir(30)]  # and the older copy once a newer one is intact


@pytest.mark.parametrize(
    ("code", "alerted"),
    [(errno.ENOSPC, True), (errno.EDQUOT, True), (errno.EACCES, False)],
)
def test_a_full_disk_skips_the_check_with_an_alert(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, code: int, alerted: bool
) -> None:
    """A download that fills the disk (played by a check that writes, then fails): the cache is
    emptied, the check skipped with an alert; any other OSError is a bug and propagates."""
    job = JobSpec(name="j", recipe="digits", total_steps=100, storage=str(tmp_path / "store"))
    cache, sink = tmp_path / "flow-cache", PlainSink()

    def filling(job: JobSpec, cache: Path, sink: object) -> ResumePoint:
        (cache / step_dir(20)).mkdir(parents=True)
        (cache / step_dir(20) / "model.safetensors").write_bytes(b"partial")
        raise OSError(code, "No space left on device")

    if not alerted:
        with pytest.raises(OSError):
            _check_checkpoints(job, cache, sink, filling)
        assert sink.events == [] and cached(cache) == [step_dir(20)]
        return
    with caplog.at_level(logging.ERROR, logger="spotrun.control"):
        assert _check_checkpoints(job, cache, sink, filling) is None
    assert not cache.exists()
    problem = f"No space left on device under {cache}"
    where = {"cache": str(cache), "host": socket.gethostname()}
    assert sink.events == [(CONTROLLER_DISK_FULL, {"job": "j", "problem": problem, **where})]
    assert "the controller's disk is full" in caplog.text and "the next check tries again" in caplog.text
