"""SPOTRUN_MANIFEST_KEY: keyed file digests, signed manifests and markers, rotation, "cannot verify"."""

from __future__ import annotations

from pathlib import Path

import pytest
import xxhash

from spotrun.trainer.checkpoint.catalog import read_latest, write_latest
from spotrun.trainer.checkpoint.format import LATEST, MANIFEST, FileEntry, Manifest, file_entry
from spotrun.trainer.checkpoint.signing import (
    KEY_ENV,
    OLD_KEYS_ENV,
    Key,
    Keyring,
    keyring,
    marker_problem,
    sign_marker,
)
from spotrun.trainer.checkpoint.validate import check_integrity
from spotrun.trainer.storage import LocalStorage, get_bytes, put_bytes

FILES = {"model.safetensors": b"weights", "optimizer.pt": b"o", "scheduler.pt": b"s", "trainer.pt": b"t"}


def _checkpoint(d: Path) -> Manifest:
    d.mkdir()
    for name, data in FILES.items():
        (d / name).write_bytes(data)
    key = keyring().signing
    files = {n: file_entry(d / n, key=key) for n in FILES}
    m = Manifest(step=5, spec_hash="a", shape_hash="b", world_size=1, files=files).signed()
    (d / MANIFEST).write_bytes(m.to_json())
    return m


def _kinds(d: Path) -> list[tuple[str, str]]:
    return [(p.kind, p.detail) for p in check_integrity(d)]


@pytest.fixture
def key(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(KEY_ENV, "s3cret")
    monkeypatch.delenv(OLD_KEYS_ENV, raising=False)
    return "s3cret"


def test_a_signed_checkpoint_names_its_algorithms_and_key_and_verifies(key: str, tmp_path: Path) -> None:
    d = tmp_path / "step_000000005"
    m = _checkpoint(d)
    assert m.signing == {"algo": "hmac-sha256", "files": "blake3_keyed", "key_id": Key(b"s3cret").id}
    assert all(e.keyed for e in m.files.values())
    assert check_integrity(d) == []


def test_a_forged_file_whose_xxh3_matches_is_caught_by_the_keyed_digest(key: str, tmp_path: Path) -> None:
    """xxh3 is not collision-resistant: model a forged same-size file whose unkeyed digest matches the
    manifest's (what a collision gives an attacker) under a valid signature."""
    d = tmp_path / "step_000000005"
    m = _checkpoint(d)
    forged = b"evilwts"  # same size as b"weights"
    (d / "model.safetensors").write_bytes(forged)
    old = m.files["model.safetensors"]
    collided = xxhash.xxh3_128(forged).hexdigest()
    m.files["model.safetensors"] = FileEntry(len(forged), collided, keyed=old.keyed)
    m.signed()  # the signature holds: only the file differs from what the key saw
    (d / MANIFEST).write_bytes(m.to_json())
    assert _kinds(d) == [("integrity", "blake3_keyed mismatch (tampered with)")]


def test_a_rewritten_file_and_digest_cannot_be_verified_and_is_not_damage(key: str, tmp_path: Path) -> None:
    d = tmp_path / "step_000000005"
    m = _checkpoint(d)
    (d / "model.safetensors").write_bytes(b"evil!!!")
    m.files["model.safetensors"] = FileEntry(7, xxhash.xxh3_128(b"evil!!!").hexdigest())
    (d / MANIFEST).write_bytes(m.to_json())  # the old signature over a new body
    ((kind, detail),) = _kinds(d)
    assert kind == "unverified" and "signature does not match" in detail


def test_without_a_key_nothing_is_signed_and_digests_catch_damage_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    d = tmp_path / "step_000000005"
    m = _checkpoint(d)
    assert m.signature is None and m.signing is None and check_integrity(d) == []
    (d / "model.safetensors").write_bytes(b"evil!!!")
    assert _kinds(d) == [("integrity", "xxh3_128 mismatch")]
    m.files["model.safetensors"] = FileEntry(7, xxhash.xxh3_128(b"evil!!!").hexdigest())
    (d / MANIFEST).write_bytes(m.to_json())
    assert check_integrity(d) == []  # an unkeyed digest detects damage, not tampering


def test_with_a_key_an_unsigned_checkpoint_cannot_be_verified_and_damage_still_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    d = tmp_path / "step_000000005"
    _checkpoint(d)  # a worker without the key
    monkeypatch.setenv(KEY_ENV, "s3cret")
    assert _kinds(d) == [("unverified", "cannot verify: not signed (SPOTRUN_MANIFEST_KEY is set here)")]
    (d / "optimizer.pt").write_bytes(b"x")  # same size, other bytes: damage, found without the key
    assert [k for k, _ in _kinds(d)] == ["unverified", "integrity"]


def test_rotation_old_keys_verify_by_key_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "old-key")
    d = tmp_path / "step_000000005"
    _checkpoint(d)
    monkeypatch.setenv(KEY_ENV, "new-key")
    monkeypatch.delenv(OLD_KEYS_ENV, raising=False)
    ((kind, detail),) = _kinds(d)
    assert kind == "unverified" and Key(b"old-key").id in detail and OLD_KEYS_ENV in detail
    monkeypatch.setenv(OLD_KEYS_ENV, "other, old-key")
    assert check_integrity(d) == []


@pytest.mark.parametrize(
    ("signer", "reader", "problem"),
    [
        (None, None, None),
        ("k", None, None),  # nothing to verify with: markers are hints, read as before
        ("k", "k", None),
        (None, "k", "not signed"),
        ("k", "j", "not held here"),
    ],
)
def test_markers(signer: str | None, reader: str | None, problem: str | None) -> None:
    ring = lambda k: Keyring(Key(k.encode())) if k else Keyring()  # noqa: E731
    marker = sign_marker({"step": 7, "dir": "step_000000007"}, ring(signer))
    found = marker_problem(marker, ring(reader))
    assert (found is None) if problem is None else (problem in str(found))


def test_a_tampered_latest_is_ignored_with_a_key(key: str, tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    write_latest(storage, 7)
    assert read_latest(storage) == 7 and b"signature" in get_bytes(storage, LATEST)
    put_bytes(storage, LATEST, get_bytes(storage, LATEST).replace(b'"step": 7', b'"step": 999'))
    assert read_latest(storage) is None


def test_a_forged_handoff_does_not_release_a_live_holder(key: str, tmp_path: Path) -> None:
    """`_handoff.json` lets a waiting trainer take a lease at once: only the controller's signed word."""
    import json

    from spotrun.trainer.preemption.lease import HANDOFF_KEY, read_handoff, write_handoff

    storage = LocalStorage(tmp_path)
    write_handoff(storage, "w1")
    assert read_handoff(storage) == ["w1"]
    put_bytes(storage, HANDOFF_KEY, json.dumps({"released": ["w2"], "at": 0}).encode())
    assert read_handoff(storage) == []


def test_a_forged_standby_hands_nothing_over(key: str, tmp_path: Path) -> None:
    """`_standby.json` tells a holder its replacement is ready: only a signed one counts."""
    import json

    from spotrun.trainer.preemption.handover import STANDBY_KEY, read_standby, write_standby

    storage = LocalStorage(tmp_path)
    write_standby(storage, "w1", "waiting", "w2")
    found = read_standby(storage)
    assert found is not None and (found.replacing, found.state, found.worker) == ("w1", "waiting", "w2")
    forged = {"replacing": "w1", "state": "waiting", "worker": "evil", "at": 0}
    put_bytes(storage, STANDBY_KEY, json.dumps(forged).encode())
    assert read_standby(storage) is None
