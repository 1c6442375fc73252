"""Table tests of the pure decisions: which checkpoint to resume from, what to delete, exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest

from spotrun.trainer.checkpoint.catalog import plan_retention, select_newest_valid
from spotrun.trainer.checkpoint.format import FileEntry, Manifest, parse_step_dir, step_dir
from spotrun.trainer.checkpoint.validate import Problem
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.session.faults import Fault

BAD = [Problem("integrity", "model.safetensors", "sha256 mismatch")]


@pytest.mark.parametrize(
    ("steps", "bad", "chosen", "rejected"),
    [
        ([], set(), None, []),
        ([10, 20, 30], set(), 30, []),
        ([10, 20, 30], {30}, 20, [30]),
        ([30, 10, 20], {30, 20}, 10, [30, 20]),
        ([10, 20, 30], {10, 20, 30}, None, [30, 20, 10]),
        ([10, 20, 30], {10}, 30, []),
    ],
)
def test_select_newest_valid(
    steps: list[int], bad: set[int], chosen: int | None, rejected: list[int]
) -> None:
    sel = select_newest_valid(steps, lambda s: (Path(str(s)), BAD if s in bad else []))
    assert sel.step == chosen
    assert [r.step for r in sel.rejected] == rejected
    assert all("sha256 mismatch in model.safetensors" in r.reason() for r in sel.rejected)


def test_selection_describes_itself() -> None:
    sel = select_newest_valid([10, 20], lambda s: (None, BAD if s == 20 else []))
    assert sel.describe("s3://b/p") == (
        "resuming from step 10 of s3://b/p; rejected step 20: sha256 mismatch in model.safetensors"
    )
    none = select_newest_valid([], lambda s: (None, []))
    assert none.describe("/x") == "no valid checkpoint in /x, starting from scratch"


@pytest.mark.parametrize(
    ("committed", "incomplete", "verified", "keep", "doomed"),
    [
        ([10, 20, 30], [], 30, 2, [10]),
        ([10, 20, 30], [], 30, 3, []),
        ([10, 20, 30, 40], [], 30, 2, [10]),  # 40 is newer than verified: maybe in flight, untouched
        (
            [10, 20, 30],
            [25, 35],
            30,
            2,
            [10, 25],
        ),  # partial writes older than verified go; 35 may be uploading
        ([30], [], 30, 2, []),  # never delete the last verified one
        ([], [5], 30, 2, [5]),
    ],
)
def test_plan_retention(
    committed: list[int], incomplete: list[int], verified: int, keep: int, doomed: list[int]
) -> None:
    assert plan_retention(committed, incomplete, verified, keep) == doomed


def test_plan_retention_refuses_keep_below_two() -> None:
    with pytest.raises(ValueError):
        plan_retention([1, 2], [], 2, 1)


def test_step_dir_round_trip() -> None:
    assert step_dir(1200) == "step_000001200"
    assert parse_step_dir(step_dir(1200)) == 1200
    assert parse_step_dir("step_12") is None and parse_step_dir("latest") is None


def test_manifest_round_trip_and_rejects_garbage() -> None:
    m = Manifest(step=5, spec_hash="a", shape_hash="b", world_size=1, files={"f": FileEntry(3, "00")})
    assert Manifest.from_json(m.to_json()) == m
    with pytest.raises(ValueError, match="malformed manifest"):
        Manifest.from_json(b'{"step": 1}')
    with pytest.raises(ValueError, match="newer than this spotrun reads"):
        Manifest.from_json(m.to_json().replace(b'"format_version": 2', b'"format_version": 99'))


@pytest.mark.parametrize(
    ("code", "retryable"),
    [
        (ExitCode.COMPLETED, False),
        (ExitCode.CRASHED, True),
        (ExitCode.CONFIG_ERROR, False),
        (ExitCode.DIVERGED, False),
        (ExitCode.STOPPED, False),
        (ExitCode.PREEMPTED, True),
    ],
)
def test_exit_codes(code: ExitCode, retryable: bool) -> None:
    assert code.retryable is retryable


def test_fault_parse() -> None:
    assert Fault.parse("sigkill@40") == Fault("sigkill", 40)
    for bad in ("sigkill", "boom@3", "crash@0", "crash@x"):
        with pytest.raises(ConfigError, match="KIND@STEP"):
            Fault.parse(bad)


def test_format_1_manifests_still_read_and_verify(tmp_path: Path) -> None:
    """A manifest written before format 2: no layout, SHA-256 per file. It parses as layout single,
    and validation checks its files with SHA-256 (a flipped byte is still caught)."""
    import hashlib
    import json

    from spotrun.trainer.checkpoint.validate import check_integrity

    d = tmp_path / "step_000000005"
    d.mkdir()
    files = {"model.safetensors": b"m" * 10, "optimizer.pt": b"o", "scheduler.pt": b"s", "trainer.pt": b"t"}
    for name, data in files.items():
        (d / name).write_bytes(data)
    listed = {n: {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for n, b in files.items()}
    v1 = {
        "format": "spotrun/1",
        "format_version": 1,
        "step": 5,
        "spec_hash": "a",
        "shape_hash": "b",
        "world_size": 1,
        "files": listed,
    }
    (d / "manifest.json").write_text(json.dumps(v1))
    m = Manifest.from_json((d / "manifest.json").read_bytes())
    assert m.format_version == 1 and m.layout == "single" and m.files["trainer.pt"].algo == "sha256"
    assert check_integrity(d) == []
    (d / "model.safetensors").write_bytes(b"m" * 9 + b"M")
    assert [str(p) for p in check_integrity(d)] == ["sha256 mismatch in model.safetensors"]
