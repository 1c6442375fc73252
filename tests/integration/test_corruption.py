"""The corruption matrix: every kind of damage is detected, the previous valid checkpoint is
selected, and the reason is recorded. Runs on both storage backends."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save

from spotrun.trainer import recipes
from spotrun.trainer.checkpoint.catalog import Catalog, list_checkpoints, write_latest
from spotrun.trainer.checkpoint.format import MANIFEST, Manifest, sha256_file, step_dir
from spotrun.trainer.checkpoint.validate import Expectation
from spotrun.trainer.errors import ResumeIncompatible
from spotrun.trainer.session.loop import AttemptOptions, run_attempt
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import LocalStorage, Storage, get_bytes, open_storage, put_bytes
from spotrun.trainer.storage.digests import digest_file
from spotrun.trainer.storage.options import S3Options
from spotrun.trainer.telemetry.status import StatusReporter, parse_status_line

SPEC = {
    "name": "matrix",
    "recipe": "digits",
    "args": {"hidden": 32},
    "total_steps": 40,
    "threads": 1,
    "checkpoint": {"every_steps": 10, "keep": 4, "async_upload": False},
}
S30 = step_dir(30)
S40 = step_dir(40)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """Every object of a run that checkpointed at steps 10, 20, 30 and 40."""
    root = tmp_path_factory.mktemp("pristine")
    store = LocalStorage(root / "store")
    result = run_attempt(JobSpec.model_validate(SPEC), store, AttemptOptions(cache=root / "cache"))
    assert result.durable_step == 40
    return {o.key: get_bytes(store, o.key) for o in store.list()}


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path, pristine: dict[str, bytes]) -> Iterator[Storage]:
    """Steps 10-30 committed and `latest` at 30; step 40 is held back for the publish cases."""
    if request.param == "local":
        store: Storage = LocalStorage(tmp_path / "store")
    else:
        endpoint, bucket = request.getfixturevalue("s3_bucket")
        store = open_storage(f"s3://{bucket}/jobs/matrix", S3Options(endpoint_url=endpoint))
    for key, data in pristine.items():
        if not key.startswith(S40) and key not in ("latest", "COMPLETED.json"):
            put_bytes(store, key, data)
    write_latest(store, 30)
    yield store


@pytest.fixture
def expect() -> Expectation:
    spec = JobSpec.model_validate(SPEC)
    parts = recipes.build("digits", spec.args, recipes.RecipeContext(0, 40, 64, torch.device("cpu")))
    return Expectation.from_parts(parts.model, parts.optimizer, spec.shape_hash())


def _flip_middle_byte(s: Storage, key: str) -> None:
    b = bytearray(get_bytes(s, key))
    b[len(b) // 2] ^= 0x01
    put_bytes(s, key, bytes(b))


def _replace_and_rehash(s: Storage, step_name: str, fname: str, data: bytes, *, tmp: Path) -> None:
    """Swap a file and fix up the manifest so integrity passes: structure/content checks must catch it."""
    put_bytes(s, f"{step_name}/{fname}", data)
    (tmp / "f").write_bytes(data)
    m = json.loads(get_bytes(s, f"{step_name}/{MANIFEST}"))
    m["files"][fname] = {"size": len(data), "sha256": sha256_file(tmp / "f")}
    put_bytes(s, f"{step_name}/{MANIFEST}", json.dumps(m).encode())


def _with_model(s: Storage, fn: Callable[[dict[str, torch.Tensor]], None], tmp: Path) -> None:
    tensors = load(get_bytes(s, f"{S30}/model.safetensors"))
    fn(tensors)
    _replace_and_rehash(
        s, S30, "model.safetensors", save(tensors, {"format": "spotrun/1", "step": "30"}), tmp=tmp
    )


def _nan(t: dict[str, torch.Tensor]) -> None:
    t["0.weight"][0, 0] = float("nan")


def _reshape(t: dict[str, torch.Tensor]) -> None:
    t["0.weight"] = torch.zeros(16, 64)


def _other_step_part(s: Storage, tmp: Path) -> None:
    _replace_and_rehash(s, S30, "trainer.pt", get_bytes(s, f"{step_dir(20)}/trainer.pt"), tmp=tmp)


def _upload_partially(pristine: dict[str, bytes]) -> Callable[[Storage, Path], None]:
    def f(s: Storage, _tmp: Path) -> None:  # killed during upload: data files, no manifest
        put_bytes(s, f"{S40}/model.safetensors", pristine[f"{S40}/model.safetensors"])

    return f


def _publish_without_latest(pristine: dict[str, bytes]) -> Callable[[Storage, Path], None]:
    def f(s: Storage, _tmp: Path) -> None:  # killed after the manifest, before read-back moved `latest`
        for key, data in pristine.items():
            if key.startswith(S40):
                put_bytes(s, key, data)

    return f


CASES: dict[str, tuple[Callable[..., None], int | None, str]] = {
    "truncated file": (
        lambda s, t: put_bytes(s, f"{S30}/model.safetensors", get_bytes(s, f"{S30}/model.safetensors")[:999]),
        20,
        "size 999 != manifest",
    ),
    "flipped byte in tensor data": (
        lambda s, t: _flip_middle_byte(s, f"{S30}/optimizer.pt"),
        20,
        "xxh3_128 mismatch in optimizer.pt",
    ),
    "missing file": (lambda s, t: s.delete([f"{S30}/scheduler.pt"]), 20, "file missing in scheduler.pt"),
    "missing manifest": (lambda s, t: s.delete([f"{S30}/{MANIFEST}"]), 20, "missing manifest"),
    "garbage manifest": (
        lambda s, t: put_bytes(s, f"{S30}/{MANIFEST}", b"{not json"),
        20,
        "malformed manifest",
    ),
    "NaN tensor": (lambda s, t: _with_model(s, _nan, t), 20, "NaN/Inf in 0.weight"),
    "wrong shape": (lambda s, t: _with_model(s, _reshape, t), 20, "0.weight: (16, 64)"),
    "parts from different steps": (_other_step_part, 20, "step 20 != manifest step 30 in trainer.pt"),
    "stale latest marker": (lambda s, t: write_latest(s, 10), 30, ""),
    "dangling latest marker": (lambda s, t: write_latest(s, 99), 30, ""),
    "malformed latest marker": (lambda s, t: put_bytes(s, "latest", b"\x00garbage"), 30, ""),
    "every checkpoint corrupt": (
        lambda s, t: [_flip_middle_byte(s, f"{step_dir(n)}/model.safetensors") for n in (10, 20, 30)],
        None,
        "xxh3_128 mismatch in model.safetensors",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_damage_is_detected_and_previous_valid_selected(
    case: str, storage: Storage, expect: Expectation, tmp_path: Path
) -> None:
    damage, chosen, reason = CASES[case]
    damage(storage, tmp_path)
    sel = Catalog(storage, tmp_path / "cache").select(expect)
    assert sel.step == chosen
    if reason:
        assert sel.rejected and reason in sel.rejected[0].reason()
        assert reason in sel.describe(storage.uri)
    else:
        assert not sel.rejected
    if chosen is None:
        assert "starting from scratch" in sel.describe(storage.uri)


def test_half_finished_upload_is_skipped(
    storage: Storage, expect: Expectation, tmp_path: Path, pristine: dict[str, bytes]
) -> None:
    _upload_partially(pristine)(storage, tmp_path)
    sel = Catalog(storage, tmp_path / "cache").select(expect)
    assert sel.step == 30
    assert sel.rejected[0].step == 40 and "missing manifest" in sel.rejected[0].reason()


def test_kill_during_publish_leaves_a_complete_newer_checkpoint_that_is_used(
    storage: Storage, expect: Expectation, tmp_path: Path, pristine: dict[str, bytes]
) -> None:
    _publish_without_latest(pristine)(storage, tmp_path)
    sel = Catalog(storage, tmp_path / "cache").select(expect)
    assert sel.step == 40 and not sel.rejected


def test_kill_during_local_save_leaves_only_ignorable_temp_files(
    expect: Expectation, tmp_path: Path, pristine: dict[str, bytes]
) -> None:
    store = LocalStorage(tmp_path / "store")
    for key, data in pristine.items():
        put_bytes(store, key, data)
    (store.root / S40 / ".spotrun-tmp-model.safetensors.1234").write_bytes(b"half")
    cache = tmp_path / "cache"
    (cache / f".tmp-{step_dir(50)}-99").mkdir(parents=True)
    sel = Catalog(store, cache).select(expect)
    assert sel.step == 40
    assert store.cleanup_incomplete(older_than_s=0) == 1


def test_resume_after_corruption_trains_on_and_retention_removes_the_bad_one(
    storage: Storage, tmp_path: Path, pristine: dict[str, bytes]
) -> None:
    _flip_middle_byte(storage, f"{S30}/model.safetensors")
    _upload_partially(pristine)(storage, tmp_path)
    spec = JobSpec.model_validate({**SPEC, "total_steps": 50})
    result = run_attempt(spec, storage, AttemptOptions(cache=tmp_path / "cache"))
    assert (result.resumed_from, result.durable_step) == (20, 50)
    listed = list_checkpoints(storage)
    assert sorted(listed) == [20, 30, 40, 50]  # keep 4; 30 and 40 rewritten by the resumed run
    assert all(c.committed for c in listed.values())
    assert Catalog(storage, tmp_path / "cache2").select(None).step == 50


def test_checkpoint_from_another_model_is_refused_and_nothing_deleted(
    storage: Storage, tmp_path: Path
) -> None:
    before = [o.key for o in storage.list()]
    other = JobSpec.model_validate({**SPEC, "args": {"hidden": 48}})
    with pytest.raises(ResumeIncompatible, match="different shape settings"):
        run_attempt(other, storage, AttemptOptions(cache=tmp_path / "cache"))
    assert [o.key for o in storage.list()] == before


def test_manifest_lists_every_file_with_size_and_hash(pristine: dict[str, bytes], tmp_path: Path) -> None:
    m = Manifest.from_json(pristine[f"{S30}/{MANIFEST}"])
    assert m.step == 30 and m.world_size == 1
    assert set(m.files) == {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer.pt", "rng.rank0.pt"}
    for name, entry in m.files.items():
        (tmp_path / name).write_bytes(pristine[f"{S30}/{name}"])
        assert (entry.size, entry.digest) == (
            len(pristine[f"{S30}/{name}"]),
            digest_file(tmp_path / name, entry.algo),
        )
    # every non-weight part loads with weights_only=True
    for name in m.files:
        if name.endswith(".pt"):
            torch.load(io.BytesIO(pristine[f"{S30}/{name}"]), weights_only=True)


def test_quarantined_checkpoint_is_rejected_with_its_reasons_even_with_an_intact_local_copy(
    storage: Storage, expect: Expectation, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    assert Catalog(storage, cache).select(expect).step == 30  # the trainer's local copy of step 30
    Catalog(storage).quarantine(30, "xxh3_128 mismatch in model.safetensors")
    sel = Catalog(storage, cache).select(expect)
    assert sel.step == 20 and sel.uri == f"{storage.uri.rstrip('/')}/{step_dir(20)}"
    assert [(r.step, r.reason()) for r in sel.rejected] == [
        (30, "quarantined: xxh3_128 mismatch in model.safetensors")
    ]


def test_integrity_only_passes_what_only_the_recipe_can_refuse(storage: Storage, tmp_path: Path) -> None:
    _with_model(storage, _reshape, tmp_path)  # rehashed: the manifest agrees with the wrong shape
    catalog = Catalog(storage, tmp_path / "cache")
    assert catalog.validate(30, None, integrity_only=True)[1] == []
    other = JobSpec.model_validate({**SPEC, "args": {"hidden": 48}})
    _, problems = catalog.validate(30, Expectation.of_shape(other.shape_hash()))
    assert [p.kind for p in problems] == ["compat"]


def test_started_record_carries_the_trainers_selection_and_rejections(
    storage: Storage, tmp_path: Path
) -> None:
    _flip_middle_byte(storage, f"{S30}/model.safetensors")
    stream = io.StringIO()
    spec = JobSpec.model_validate({**SPEC, "total_steps": 30})
    run_attempt(spec, storage, AttemptOptions(cache=tmp_path / "cache", reporter=StatusReporter(stream)))
    records = [r.to_json() for line in stream.getvalue().splitlines() if (r := parse_status_line(line))]
    started = next(r for r in records if r["kind"] == "started")
    assert started["resumed_from"] == 20
    assert started["checkpoint"] == f"{storage.uri.rstrip('/')}/{step_dir(20)}"
    assert started["rejected"] == [{"step": 30, "reason": "xxh3_128 mismatch in model.safetensors"}]
