"""SPOTRUN_MANIFEST_KEY: manifests signed with an HMAC; a rewritten file with a rewritten digest is caught."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.ckpt_format import MANIFEST, FileEntry, Manifest
from trainer.digests import digest_file
from trainer.signing import KEY_ENV
from trainer.validate import check_integrity

FILES = {"model.safetensors": b"weights", "optimizer.pt": b"o", "scheduler.pt": b"s", "trainer.pt": b"t"}


def _checkpoint(d: Path) -> Manifest:
    d.mkdir()
    for name, data in FILES.items():
        (d / name).write_bytes(data)
    files = {n: FileEntry(len(b), digest_file(d / n)) for n, b in FILES.items()}
    m = Manifest(step=5, spec_hash="a", shape_hash="b", world_size=1, files=files).signed()
    (d / MANIFEST).write_bytes(m.to_json())
    return m


def _tamper(d: Path, m: Manifest) -> None:
    """What someone with write access to the bucket can do: new weights, and the digest to match."""
    (d / "model.safetensors").write_bytes(b"evil!!!")
    m.files["model.safetensors"] = FileEntry(7, digest_file(d / "model.safetensors"))
    (d / MANIFEST).write_bytes(m.to_json())


def test_a_signed_manifest_catches_a_rewritten_file_and_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, "s3cret")
    d = tmp_path / "step_000000005"
    m = _checkpoint(d)
    assert m.signature and check_integrity(d) == []
    _tamper(d, m)
    (problem,) = check_integrity(d)
    assert "signature does not match" in str(problem)
    monkeypatch.setenv(KEY_ENV, "another")  # signed with another key: refused as well
    d2 = tmp_path / "other"
    monkeypatch.setenv(KEY_ENV, "s3cret")
    _checkpoint(d2)
    monkeypatch.setenv(KEY_ENV, "another")
    assert "signature does not match" in str(check_integrity(d2)[0])


def test_without_a_key_nothing_is_signed_and_with_one_unsigned_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    d = tmp_path / "step_000000005"
    m = _checkpoint(d)
    assert m.signature is None and check_integrity(d) == []
    _tamper(d, m)
    assert check_integrity(d) == []  # an unkeyed digest detects damage, not tampering
    monkeypatch.setenv(KEY_ENV, "s3cret")
    assert "manifest is not signed" in str(check_integrity(d)[0])
