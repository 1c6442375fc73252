from __future__ import annotations

from pathlib import Path

import pytest

from trainer.errors import ConfigError
from trainer.spec import JobSpec, load_spec, parse_spec

BASE = {"name": "j", "recipe": "digits", "total_steps": 10}


def test_minimal_spec_gets_defaults() -> None:
    s = parse_spec(BASE)
    assert s.checkpoint.keep == 3 and s.checkpoint.every_steps == 100
    assert s.world_size == 1 and s.storage


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"name": "j", "recipe": "digits"}, "field 'total_steps': Field required - add it"),
        ({**BASE, "total_step": 5}, "field 'total_step': Extra inputs are not permitted - remove it"),
        ({**BASE, "checkpoint": {"keep": 1}}, "field 'checkpoint.keep'"),
        ({**BASE, "checkpoint": {"every_steps": None}}, "set every_steps and/or every_seconds"),
        ({**BASE, "storage": "gs://b/p"}, "unsupported scheme"),
        ({**BASE, "total_steps": 0}, "field 'total_steps'"),
        ({**BASE, "name": "has space"}, "field 'name'"),
        ({**BASE, "recipe": "pkg.mod:"}, "package.module:function"),
        ({**BASE, "s3": {"sse": "rot13"}}, "field 's3.sse'"),
    ],
)
def test_bad_specs_fail_with_one_line_naming_the_field(data: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_spec(data)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_not_a_mapping() -> None:
    with pytest.raises(ConfigError, match="expected a mapping"):
        parse_spec(["a", "b"])


def test_malformed_yaml_names_the_line(tmp_path: Path) -> None:
    p = tmp_path / "job.yaml"
    p.write_text("name: j\nrecipe: [digits\ntotal_steps: 3\n")
    with pytest.raises(ConfigError, match=r"job.yaml: line \d+ is not valid YAML"):
        load_spec(p)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read job file"):
        load_spec(tmp_path / "nope.yaml")


def test_shape_hash_tracks_only_shape_fields() -> None:
    a = JobSpec.model_validate(BASE)
    assert a.shape_hash() == a.model_copy(update={"total_steps": 99, "seed": 3}).shape_hash()
    assert a.shape_hash() != a.model_copy(update={"args": {"hidden": 8}}).shape_hash()
    assert a.shape_hash() != a.model_copy(update={"batch_size": 8}).shape_hash()
    assert a.spec_hash() != a.model_copy(update={"total_steps": 99}).spec_hash()


def test_example_jobs_are_valid() -> None:
    jobs = sorted((Path(__file__).parents[2] / "deployments" / "jobs").glob("*.yaml"))
    assert jobs
    for p in jobs:
        load_spec(p)
