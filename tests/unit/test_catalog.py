"""Catalog selection as a table: which checkpoint an attempt resumes from, and why newer ones were
passed over, over intact, damaged, partial and quarantined step directories (integrity only: no model)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from spotrun.trainer.checkpoint.catalog import Catalog
from spotrun.trainer.checkpoint.format import MANIFEST, REQUIRED_FILES, FileEntry, Manifest, step_dir
from spotrun.trainer.storage import LocalStorage, ObjectInfo, put_bytes


def _write(store: LocalStorage, step: int, state: str) -> None:
    """One step directory: `ok`, `damaged` (a byte flipped after hashing), `partial` (no manifest),
    or `quarantined` (a flow moved its manifest into REJECTED.json)."""
    name = step_dir(step)
    files = {f: f"{f} of step {step}".encode() for f in REQUIRED_FILES}
    entries = {f: FileEntry(len(b), hashlib.sha256(b).hexdigest(), "sha256") for f, b in files.items()}
    if state == "damaged":
        files["model.safetensors"] = files["model.safetensors"][::-1]
    for f, b in files.items():
        put_bytes(store, f"{name}/{f}", b)
    if state != "partial":
        put_bytes(
            store,
            f"{name}/{MANIFEST}",
            Manifest(step, "spec", "shape", world_size=1, files=entries).to_json(),
        )
    if state == "quarantined":
        Catalog(store).quarantine(step, "sha256 mismatch in model.safetensors")


SHA = "sha256 mismatch in model.safetensors"
PARTIAL = "missing manifest (incomplete or interrupted write) in manifest.json"
QUARANTINED = f"quarantined: {SHA}"
ALL_THREE = [(30, PARTIAL), (20, QUARANTINED), (10, SHA)]


@pytest.mark.parametrize(
    ("dirs", "only_step", "chosen", "rejected"),
    [
        ({}, None, None, []),
        ({10: "ok", 20: "ok"}, None, 20, []),
        ({10: "ok", 20: "damaged"}, None, 10, [(20, SHA)]),
        ({10: "ok", 20: "ok", 30: "partial"}, None, 20, [(30, PARTIAL)]),
        ({10: "ok", 20: "quarantined"}, None, 10, [(20, QUARANTINED)]),
        ({10: "damaged", 20: "quarantined", 30: "partial"}, None, None, ALL_THREE),
        ({10: "damaged", 20: "ok"}, None, 20, []),  # older damage is never looked at
        ({10: "ok", 20: "ok"}, 10, 10, []),  # an explicit step, though a newer one is valid
        ({10: "ok", 20: "damaged"}, 20, None, [(20, SHA)]),
        ({10: "ok"}, 99, None, []),  # no such step: nothing to choose, nothing rejected
    ],
)
def test_select(
    tmp_path: Path,
    dirs: dict[int, str],
    only_step: int | None,
    chosen: int | None,
    rejected: list[tuple[int, str]],
) -> None:
    store = LocalStorage(tmp_path / "store")
    for step, state in dirs.items():
        _write(store, step, state)
    sel = Catalog(store, tmp_path / "cache").select(None, only_step, integrity_only=True)
    assert sel.step == chosen
    assert [(r.step, r.reason()) for r in sel.rejected] == rejected
    assert sel.uri == (None if chosen is None else f"{store.uri}/{step_dir(chosen)}")
    assert sel.rejected_records() == [{"step": s, "reason": why} for s, why in rejected]


def test_rejected_records_are_bounded(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "store")
    for step in range(1, 26):
        _write(store, step, "partial")
    sel = Catalog(store, tmp_path / "cache").select(None)
    assert len(sel.rejected) == 25 and [r["step"] for r in sel.rejected_records()] == list(range(25, 5, -1))


def test_quarantine_keeps_the_evidence_and_retention_removes_it(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "store")
    for step, state in ((10, "ok"), (20, "ok"), (30, "quarantined"), (40, "ok")):
        _write(store, step, state)
    catalog = Catalog(store)
    listed = catalog.list()
    assert not listed[30].committed and "REJECTED.json" in listed[30].files
    assert catalog.retain(verified=40, keep=2) == [10]  # a young incomplete directory stays
    assert catalog.retain(verified=40, keep=2, orphan_age_s=0) == [30]
    assert sorted(catalog.list()) == [20, 40]


def test_retention_keeps_an_incomplete_directory_whose_manifest_the_listing_missed(tmp_path: Path) -> None:
    """A lagging listing (an S3-compatible store) shows a committed checkpoint without its manifest."""

    class Lagging(LocalStorage):
        def list(self, prefix: str = "") -> list[ObjectInfo]:
            return [o for o in super().list(prefix) if o.key != f"{step_dir(30)}/{MANIFEST}"]

    store = Lagging(tmp_path / "store")
    for step in (10, 20, 30, 40):
        _write(store, step, "ok")
    assert Catalog(store).retain(verified=40, keep=2, orphan_age_s=0) == [10]
    assert (store.root / step_dir(30) / MANIFEST).is_file()


class NotLocal(LocalStorage):
    """An object store as far as reading goes: its checkpoints must be fetched into a cache."""

    def local_path(self, key: str) -> None:
        return None


def test_a_directory_store_is_read_in_place(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "store")
    _write(store, 10, "ok")
    path, problems = Catalog(store).validate(10, None, integrity_only=True)  # no cache, nothing copied
    assert path == store.root / step_dir(10) and problems == []


def test_validate_without_a_cache_says_what_is_missing(tmp_path: Path) -> None:
    store = NotLocal(tmp_path / "store")
    _write(store, 10, "ok")
    with pytest.raises(ValueError, match="cache directory"):
        Catalog(store).validate(10, None)
    assert Catalog(store).validate(11, None)[1][0].detail == "no such checkpoint"
    path, problems = Catalog(store, tmp_path / "cache").validate(10, None, integrity_only=True)
    assert path == tmp_path / "cache" / step_dir(10) and problems == []


@pytest.mark.parametrize(
    ("dirs", "checked", "quarantined"),
    [
        ({}, [], []),
        ({10: "ok", 20: "ok", 30: "ok"}, [30], []),  # the newest is intact: nothing older is fetched
        ({10: "ok", 20: "ok", 30: "damaged"}, [30, 20], [30]),
        ({10: "damaged", 20: "ok", 30: "ok"}, [30], []),  # older damage waits until it is next in line
        ({10: "damaged", 20: "damaged", 30: "partial"}, [20, 10], [10, 20]),
    ],
)
def test_the_controller_hashes_down_to_the_newest_intact_checkpoint(
    tmp_path: Path, dirs: dict[int, str], checked: list[int], quarantined: list[int]
) -> None:
    from spotrun.tasks.control.checkpoints import check_integrity, validate_newest
    from spotrun.tasks.control.loop import PlainSink
    from spotrun.trainer.spec.job import JobSpec

    store = LocalStorage(tmp_path / "store")
    for step, state in dirs.items():
        _write(store, step, state)
    job = JobSpec(name="j", recipe="digits", total_steps=100, storage=str(tmp_path / "store"))
    assert [r.step for r in validate_newest(job, tmp_path / "cache")] == checked
    point = check_integrity(job, tmp_path / "cache", PlainSink())
    uncommitted = [s for s, e in sorted(Catalog(store).list().items()) if not e.committed]
    assert [s for s in uncommitted if dirs[s] != "partial"] == quarantined
    intact = [s for s in checked if dirs[s] == "ok"]
    assert point.step == (intact[0] if intact else None)


def test_the_controller_never_quarantines_what_it_cannot_verify(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker without SPOTRUN_MANIFEST_KEY wrote these: the controller with the key alerts and keeps
    them (retention would otherwise delete every quarantined one)."""
    from spotrun.tasks.control.checkpoints import CHECKPOINT_UNVERIFIED, check_integrity
    from spotrun.tasks.control.loop import PlainSink
    from spotrun.trainer.spec.job import JobSpec

    class Recording(PlainSink):
        events: list[tuple[str, dict[str, object]]] = []

        def event(self, name: str, job: str, payload: dict, labels: dict | None = None) -> None:  # type: ignore[type-arg]
            self.events.append((name, payload))

    store = LocalStorage(tmp_path / "store")
    for step in (10, 20):
        _write(store, step, "ok")
    monkeypatch.setenv("SPOTRUN_MANIFEST_KEY", "k")
    job = JobSpec(name="j", recipe="digits", total_steps=100, storage=str(store.root))
    sink = Recording()
    point = check_integrity(job, tmp_path / "cache", sink)
    assert point.step is None and all(e.committed for e in Catalog(store).list().values())
    assert [(n, p["step"]) for n, p in sink.events] == [(CHECKPOINT_UNVERIFIED, s) for s in (20, 10)]
