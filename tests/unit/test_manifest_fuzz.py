"""Manifest parsing under hypothesis: whatever a bucket holds, parsing either raises the documented
ValueError or returns a manifest whose every file name stays inside its directory; the one name
rule (trainer/checkpoint/safe_names.py) agrees with path resolution."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spotrun.trainer.checkpoint.format import Manifest
from spotrun.trainer.checkpoint.safe_names import contained, name_problem

BASE = Path("/srv/cache/step_000000100")
# names built from the pieces an attacker would use, and arbitrary text beside them
pieces = st.sampled_from(["..", ".", "", "/", "a", "model.safetensors", "\x00", "\\", "~", "x" * 130, "é"])
names = st.one_of(st.lists(pieces, max_size=8).map("/".join), st.text(max_size=40))
entry = st.fixed_dictionaries({"size": st.integers(-5, 10**12), "xxh3_128": st.text(max_size=32)})
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)


def _manifest(files: dict[str, Any], step: Any) -> bytes:
    return json.dumps(
        {
            "format_version": 2,
            "layout": "single",
            "step": step,
            "spec_hash": "s",
            "shape_hash": "h",
            "world_size": 1,
            "files": files,
        }
    ).encode()


def _parse(data: bytes, dir_step: int | None = 100) -> Manifest | None:
    try:
        return Manifest.from_json(data, dir_step)
    except ValueError:
        return None  # the documented rejection; anything else escapes and fails the test


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(names, entry | json_values, max_size=5), st.one_of(st.just(100), json_values))
def test_a_parsed_manifest_names_only_files_inside_its_directory(files: dict[str, Any], step: Any) -> None:
    m = _parse(_manifest(files, step))
    if m is None:
        return
    assert m.step == 100
    for name in m.files:
        target = contained(BASE, name)  # raises if it would leave the directory
        assert BASE in target.parents


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_arbitrary_bytes_are_a_manifest_or_a_value_error(data: bytes) -> None:
    _parse(data)
    _parse(data, None)


@settings(max_examples=500, deadline=None)
@given(names)
def test_the_name_rule_agrees_with_resolution(name: str) -> None:
    if name_problem(name) is None:
        assert BASE in (BASE / name).resolve().parents
        assert "\x00" not in name and not name.startswith("/") and ".." not in name.split("/")
