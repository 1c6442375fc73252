"""A bucket someone else can write: hostile manifests and pickles are refused, never obeyed.

Every reader of a store (`spotrun checkpoints list` and `verify`, the controller's check between
attempts, a resuming trainer's selection, model registration at completion) against a directory
store and S3 (moto): a manifest naming files by absolute or `../` paths, with NUL, very long or too
deep names, duplicate keys, a reserved name, or a step other than its directory's writes nothing
outside, and is rejected with its reason; an older good checkpoint stays the resume point. Pickles
that would create a marker file, in DCP's `.metadata`, in a `.distcp` byte entry and in a `.pt` part,
with digests to match, never run.
"""

from __future__ import annotations

import io
import json
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.api import CheckpointException

from spotrun.cli import main
from spotrun.tasks.control.checkpoints import validate_newest
from spotrun.tasks.tracking.tracker import _final_weights
from spotrun.trainer.checkpoint.catalog import Catalog
from spotrun.trainer.checkpoint.format import MANIFEST, REQUIRED_FILES, model_metadata, step_dir
from spotrun.trainer.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner, load_full_state
from spotrun.trainer.checkpoint.validate import Expectation
from spotrun.trainer.session.resume import select
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import open_storage
from spotrun.trainer.storage.options import S3Options

GOOD, HOSTILE = 50, 100


class Marker:
    """Unpickling this creates `path`: what a hostile pickle would do instead of anything worse."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def _entry(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}


def _manifest(step: int, files: dict[str, bytes], **extra: Any) -> dict[str, Any]:
    return {
        "format": "spotrun/2",
        "format_version": 2,
        "layout": "single",
        "step": step,
        "spec_hash": "s",
        "shape_hash": "h",
        "world_size": 1,
        "files": {n: _entry(b) for n, b in files.items()},
        **extra,
    }


def _plain_files(step: int) -> dict[str, bytes]:
    """A small checkpoint that passes every check spotrun makes without a recipe."""
    from safetensors.torch import save

    def part(state: Any) -> bytes:
        buf = io.BytesIO()
        torch.save({"step": step, "state": state}, buf)
        return buf.getvalue()

    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    return {
        "model.safetensors": save({"w": torch.zeros(2)}, metadata=model_metadata(step)),
        "optimizer.pt": part(opt.state_dict()),
        "scheduler.pt": part({}),
        "trainer.pt": part({"spec": {}, "shape_hash": "h"}),
    }


@dataclass
class Store:
    uri: str
    s3: S3Options | None
    put: Callable[[str, bytes], object]  # a raw key under the job's prefix, as a bucket writer puts it

    @property
    def cli(self) -> list[str]:
        return [self.uri] + (["--endpoint-url", str(self.s3.endpoint_url)] if self.s3 else [])


@pytest.fixture(params=["dir", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "dir":
        root = tmp_path / "victim"

        def put_file(key: str, data: bytes) -> None:
            if "\x00" in key or any(len(part) > 255 for part in key.split("/")):
                return  # no file system holds such a name; the manifest names it all the same
            p = root / key
            if root.resolve() in p.resolve().parents:  # a directory holds no key outside itself
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(data)

        return Store(str(root), None, put_file)
    endpoint, bucket = request.getfixturevalue("s3_bucket")
    client = boto3.client("s3", endpoint_url=endpoint)
    return Store(
        f"s3://{bucket}/jobs/victim",
        S3Options(endpoint_url=endpoint),
        lambda key, data: client.put_object(Bucket=bucket, Key=f"jobs/victim/{key}", Body=data),
    )


def _write(store: Store, step: int, manifest: dict[str, Any] | bytes, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        store.put(f"{step_dir(step)}/{name}", data)
    body = manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode()
    store.put(f"{step_dir(step)}/{MANIFEST}", body)


Build = Callable[[int], tuple[dict[str, Any] | bytes, dict[str, bytes]]]


def _cases(outside: Path) -> list[tuple[str, Build, str]]:
    """(name, what the bucket writer puts as step `HOSTILE + i`: manifest and files, the reason)."""

    def named(name: str) -> Build:
        def build(step: int) -> tuple[dict[str, Any] | bytes, dict[str, bytes]]:
            files = _plain_files(step) | {name: b"pwned"}
            return _manifest(step, files), files

        return build

    def duplicate(step: int) -> tuple[dict[str, Any] | bytes, dict[str, bytes]]:
        files = _plain_files(step)
        body = json.dumps(_manifest(step, files))
        return body.replace(f'"step": {step},', f'"step": {step}, "step": 7,').encode(), files

    def other_step(step: int) -> tuple[dict[str, Any] | bytes, dict[str, bytes]]:
        files = _plain_files(step)
        return _manifest(999_999_999, files), files

    up = "../" * 16
    return [
        ("absolute", named(str(outside / "pwned-abs.txt")), "is an absolute path"),
        ("dotdot", named("../../pwned-rel.txt"), "'.' or '..' component"),  # the cache's parent
        ("dotdot-deep", named(up + str(outside / "pwned-rel.txt").lstrip("/")), "deeper than 4"),
        ("nul", named("model\x00.safetensors"), "characters outside"),
        ("backslash", named("..\\..\\pwned.txt"), "characters outside"),
        ("long", named("a" * 5000), "longer than 255"),
        ("deep", named("a/b/c/d/e.pt"), "deeper than 4"),
        ("reserved", named(MANIFEST), "is reserved"),
        ("duplicate", duplicate, "duplicate key 'step'"),
        ("step", other_step, "manifest says step 999999999"),
    ]


def test_hostile_manifests_are_rejected_by_every_reader_and_write_nothing_outside(
    store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One store holds a good checkpoint and, in the step directories above it, one hostile manifest
    of each kind (with the keys it names put beside it, where the store can hold them)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    files = _plain_files(GOOD)
    _write(store, GOOD, _manifest(GOOD, files), files)
    reasons: dict[int, str] = {}
    for i, (_, build, reason) in enumerate(_cases(outside)):
        manifest, files = build(HOSTILE + i)
        _write(store, HOSTILE + i, manifest, files)
        reasons[HOSTILE + i] = reason
    storage = open_storage(store.uri, store.s3, create=False)
    cache = tmp_path / "cache"

    assert main(["checkpoints", "list", "--json", *store.cli]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[GOOD]["valid"], rows[GOOD]["problems"]
    for step, reason in reasons.items():
        assert not rows[step]["valid"] and reason in rows[step]["problems"][0]["detail"], rows[step]

    assert main(["checkpoints", "verify", *store.cli]) == 1
    assert reasons[max(reasons)] in capsys.readouterr().out

    s3 = store.s3 or S3Options()
    job = JobSpec(name="victim", recipe="digits", total_steps=500, storage=store.uri, s3=s3)
    reports = validate_newest(job, cache)  # down to the newest intact one: every hostile one on the way
    assert [r.step for r in reports] == [*sorted(reasons, reverse=True), GOOD]
    assert all(reasons[r.step] in r.problems[0] for r in reports[:-1]), reports

    selection = select(storage, cache, Expectation(), None)
    assert selection.step == GOOD
    assert all(reasons[r.step] in r.reason() for r in selection.rejected)
    assert sorted(r.step for r in selection.rejected) == sorted(reasons)

    for step in reasons:
        with _final_weights(storage, step) as weights:
            assert weights is None

    assert list(outside.iterdir()) == [] and not (tmp_path / "pwned-rel.txt").exists()
    for f in cache.rglob("*"):  # anything fetched stays inside the cache
        assert cache.resolve() in f.resolve().parents


# ---- pickles with digests to match ----


def _sharded_checkpoint(d: Path, step: int) -> dict[str, bytes]:
    """A real DCP checkpoint (model and optimizer, one process) plus the parts spotrun adds."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, 3)).sum().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(d))
    for name in ("scheduler.pt", "trainer.pt"):
        torch.save({"step": step, "state": {}}, d / name)
    return {p.name: p.read_bytes() for p in d.iterdir()}


def _commit(d: Path, step: int, layout: str = "sharded") -> None:
    files = {p.name: p.read_bytes() for p in d.iterdir() if p.name != MANIFEST}
    (d / MANIFEST).write_text(json.dumps(_manifest(step, files, layout=layout)))


def _readers(root: Path, step: int, capsys: pytest.CaptureFixture[str], sharded: bool = True) -> list[str]:
    """Every reader's verdict on `step` of the directory store at `root`: what each reported."""
    storage = open_storage(str(root), create=False)
    d = root / step_dir(step)
    assert main(["checkpoints", "list", "--json", str(root)]) == 0
    found = [json.dumps(r["problems"]) for r in json.loads(capsys.readouterr().out)]
    main(["checkpoints", "verify", str(root)])
    found.append(capsys.readouterr().out)
    sel = Catalog(storage, root.parent / "cache").select(Expectation())
    found.append("; ".join(r.reason() for r in sel.rejected))
    with _final_weights(storage, step) as weights:
        found.append(f"registered: {weights}")
    for load in (
        lambda: dcp.load({}, storage_reader=SafeFileSystemReader(d), planner=SafeLoadPlanner()),
        lambda: load_full_state(d),
    ):
        try:
            load() if sharded else None
        except (Exception, CheckpointException) as e:  # the safe readers refuse: nothing may have run
            found.append(f"{type(e).__name__}: {e}")
    return found


def test_a_pickle_in_dcp_metadata_never_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, marker = tmp_path / "store", tmp_path / "ran-metadata"
    d = root / step_dir(HOSTILE)
    _sharded_checkpoint(d, HOSTILE)
    (d / ".metadata").write_bytes(pickle.dumps(Marker(marker)))
    _commit(d, HOSTILE)
    found = _readers(root, HOSTILE, capsys)
    assert not marker.exists()
    assert "refused to unpickle io.open" in found[0] and "refused to unpickle" in found[-1]


def test_a_pickle_in_a_distcp_byte_entry_never_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The optimizer's param groups are DCP byte entries, loaded with torch.load: point one at a pickle
    appended to the shard (an index rewritten with DCP's own classes, digests recomputed)."""
    root, marker = tmp_path / "store", tmp_path / "ran-distcp"
    d = root / step_dir(HOSTILE)
    _sharded_checkpoint(d, HOSTILE)
    md = pickle.loads((d / ".metadata").read_bytes())
    shard = d / "__0_0.distcp"
    evil = io.BytesIO()
    torch.save(Marker(marker), evil)
    index = next(i for i in md.storage_data if i.fqn.endswith("param_groups.0.lr"))
    info = md.storage_data[index]
    md.storage_data[index] = type(info)(info.relative_path, shard.stat().st_size, len(evil.getvalue()))
    with shard.open("ab") as f:
        f.write(evil.getvalue())
    (d / ".metadata").write_bytes(pickle.dumps(md))
    _commit(d, HOSTILE)
    found = _readers(root, HOSTILE, capsys)
    assert not marker.exists()
    assert "Weights only load failed" in found[-1] or "Unsupported global" in found[-1]


def test_a_pickle_in_a_pt_part_never_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, marker = tmp_path / "store", tmp_path / "ran-pt"
    d = root / step_dir(HOSTILE)
    d.mkdir(parents=True)
    for name in REQUIRED_FILES:
        torch.save({"step": HOSTILE, "state": {}}, d / name)
    torch.save({"step": HOSTILE, "state": Marker(marker)}, d / "optimizer.pt")
    _commit(d, HOSTILE, layout="single")
    found = _readers(root, HOSTILE, capsys, sharded=False)
    assert not marker.exists()
    assert "optimizer.pt" in found[1] and "unsafe or unreadable" in found[1]


def test_a_checkpoints_own_spec_names_no_code_to_import(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`verify --structure` builds the recipe a checkpoint's trainer.pt names, when --spec names none:
    a built-in name only; an import string there is the store's word, and imports nothing."""
    marker = tmp_path / "imported"
    monkeypatch.setenv("SPOTRUN_TEST_IMPORT_MARKER", str(marker))
    root = tmp_path / "store"
    d = root / step_dir(HOSTILE)
    d.mkdir(parents=True)
    recipe = "tests.fakes.import_marker:build"
    spec = JobSpec(name="victim", recipe=recipe, total_steps=500, storage=str(root))
    files = _plain_files(HOSTILE)
    buf = io.BytesIO()
    torch.save({"step": HOSTILE, "state": {"spec": spec.model_dump(mode="json"), "shape_hash": "h"}}, buf)
    files["trainer.pt"] = buf.getvalue()
    for name, data in files.items():
        (d / name).write_bytes(data)
    _commit(d, HOSTILE, layout="single")
    main(["checkpoints", "verify", str(root), "--structure"])
    capsys.readouterr()
    assert not marker.exists()
