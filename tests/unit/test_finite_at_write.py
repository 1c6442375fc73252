"""NaN/Inf is checked once, where a checkpoint is written: the manifest marks each file whose tensors
were all finite, and validation then reads shapes and dtypes alone (tables on real files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save

from spotrun.trainer.checkpoint.format import (
    MANIFEST,
    FileEntry,
    Manifest,
    model_metadata,
    write_checkpoint_dir,
)
from spotrun.trainer.checkpoint.state import capture_rng
from spotrun.trainer.checkpoint.stateful import Expectation
from spotrun.trainer.checkpoint.validate import validate_dir
from spotrun.trainer.storage.digests import digest_file

SHAPE_HASH = "h" * 8


def _model(width: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 3))


def _write(parent: Path, model: torch.nn.Module, poison: str | None = None) -> Path:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, model[0].in_features)).sum().backward()
    opt.step()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    if poison is not None:
        weights[poison].view(-1)[0] = float("inf")
    meta = {"step": 7, "rank": 0, "world_size": 1, "spec": {}, "shape_hash": SHAPE_HASH}
    snap: dict[str, Any] = {
        "model": weights,
        "optimizer": opt.state_dict(),
        "scheduler": {"last_epoch": 7},
        "scaler": None,
        "rng": capture_rng(torch.device("cpu")),
        "trainer": meta,
    }
    base = {"step": 7, "spec_hash": "s" * 8, "shape_hash": SHAPE_HASH, "world_size": 1}
    return write_checkpoint_dir(parent, snap, base)[0]


def _expect() -> Expectation:
    model = _model()
    return Expectation.from_parts(model, torch.optim.AdamW(model.parameters()), SHAPE_HASH)


def _files(d: Path) -> dict[str, dict[str, Any]]:
    return dict(json.loads((d / MANIFEST).read_bytes())["files"])


def test_a_finite_checkpoint_is_marked_file_by_file_and_validates(tmp_path: Path) -> None:
    d = _write(tmp_path, _model())
    assert {f: e.get("finite") for f, e in _files(d).items()} == {
        "model.safetensors": True,
        "optimizer.pt": True,
        "scheduler.pt": True,
        "rng.rank0.pt": True,
        "trainer.pt": True,
    }
    assert validate_dir(d, _expect()) == []


def test_a_nonfinite_tensor_leaves_its_file_unmarked_and_validation_names_it(tmp_path: Path) -> None:
    d = _write(tmp_path, _model(), poison="0.bias")
    assert "finite" not in _files(d)["model.safetensors"]
    assert _files(d)["optimizer.pt"]["finite"] is True
    assert [str(p) for p in validate_dir(d, _expect())] == ["NaN/Inf in 0.bias in model.safetensors"]


@pytest.mark.parametrize(
    ("width", "problem"),
    [
        (6, "0.bias: (6,) torch.float32, expected ((8,), torch.float32) in model.safetensors"),
        (8, None),
    ],
)
def test_structure_is_checked_from_headers_when_the_values_are_known_finite(
    tmp_path: Path, width: int, problem: str | None
) -> None:
    d = _write(tmp_path, _model(width))
    found = [str(p) for p in validate_dir(d, _expect())]
    assert (found[0] if found else None) == problem


def test_a_marked_file_is_trusted_for_its_values_and_an_unmarked_one_is_scanned(tmp_path: Path) -> None:
    """The mark stands for the writer's check of exactly these bytes (the digest proves them; a key
    signs the mark with the rest). A file swapped and rehashed by hand carries no mark: scanned."""
    d = _write(tmp_path, _model())
    weights = load_file(str(d / "model.safetensors"))
    weights["1.weight"].view(-1)[0] = float("nan")
    (d / "model.safetensors").write_bytes(save(weights, model_metadata(7)))
    m = Manifest.from_json((d / MANIFEST).read_bytes())
    p = d / "model.safetensors"
    for finite, problems in [(True, []), (False, ["NaN/Inf in 1.weight in model.safetensors"])]:
        m.files[p.name] = FileEntry(p.stat().st_size, digest_file(p), finite=finite)
        (d / MANIFEST).write_bytes(m.to_json())
        assert [str(x) for x in validate_dir(d, _expect())] == problems


@pytest.mark.parametrize(
    ("entry", "finite"),
    [
        ({"size": 3, "xxh3_128": "ab"}, False),  # written before the mark, or by hand
        ({"size": 3, "sha256": "ab"}, False),  # format 1
        ({"size": 3, "xxh3_128": "ab", "finite": True}, True),
        ({"size": 3, "xxh3_128": "ab", "finite": "yes"}, False),  # only a JSON true counts
    ],
)
def test_the_mark_is_read_from_manifests_old_and_new(entry: dict[str, Any], finite: bool) -> None:
    raw = {"format_version": 2, "step": 1, "spec_hash": "s", "shape_hash": "h", "world_size": 1}
    m = Manifest.from_json(json.dumps(raw | {"files": {"f": entry}}).encode())
    assert m.files["f"].finite is finite
    again = Manifest.from_json(m.to_json()).files["f"]
    assert again == m.files["f"]
