from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from spotrun.trainer.errors import ConfigError
from spotrun.trainer.spec.job import JobSpec, load_spec, parse_spec, spec_changes
from spotrun.trainer.spec.messages import explain_errors

BASE = {"name": "j", "recipe": "digits", "total_steps": 10}


def test_minimal_spec_gets_defaults() -> None:
    s = parse_spec(BASE)
    assert s.checkpoint.keep == 3 and s.checkpoint.every_steps == 100
    assert s.world_size == 1 and s.storage


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"name": "j", "recipe": "digits"}, "field 'total_steps': Field required - add it"),
        ({**BASE, "zzz": 5}, "field 'zzz': Extra inputs are not permitted - remove it"),
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


NO_STEPS = {"name": "j", "recipe": "digits"}
UNKNOWN = "Extra inputs are not permitted - remove it or check its spelling"


def typo(field: str, where: str, meant: str, more: str = "") -> str:
    return f"field '{field}' is not {where}: did you mean '{meant}'? (rename it in the job file){more}"


@pytest.mark.parametrize(
    ("data", "line"),
    [
        # a misspelt required key: one problem, named with the field it meant, not "Field required"
        ({**NO_STEPS, "total_step": 5}, typo("total_step", "a job field", "total_steps")),
        ({"recipe": "digits", "nme": "j", "total_step": 5}, typo("nme", "a job field", "name", " (+1 more)")),
        (
            {**NO_STEPS, "name": "a b", "total_step": 5},
            typo("total_step", "a job field", "total_steps", " (+1 more)"),
        ),
        # a misspelt optional key, at the top and nested (an alias is what people write)
        ({**BASE, "batch_sise": 8}, typo("batch_sise", "a job field", "batch_size")),
        ({**BASE, "checkpoint": {"kep": 2}}, typo("checkpoint.kep", "a field of 'checkpoint'", "keep")),
        (
            {**BASE, "distributed": {"nproc_per_nod": 2}},
            typo("distributed.nproc_per_nod", "a field of 'distributed'", "nproc_per_node"),
        ),
        ({**BASE, "tracking": {"registr": 0}}, typo("tracking.registr", "a field of 'tracking'", "register")),
        # no likely field (one already given is none): the unknown key first, then a count of the rest
        ({**BASE, "seed": 1, "seeds": 2}, f"field 'seeds': {UNKNOWN}"),
        (
            {**BASE, "tracking": {"register": 0, "register_modl": 1}},
            f"field 'tracking.register_modl': {UNKNOWN}",
        ),
        ({**NO_STEPS, "zzz": 5}, f"field 'zzz': {UNKNOWN} (+1 more)"),
        ({**BASE, "total_steps": 0, "zzz": 5}, f"field 'zzz': {UNKNOWN} (+1 more)"),
        (NO_STEPS, "field 'total_steps': Field required - add it to the job file"),
    ],
)
def test_an_unknown_key_comes_first_with_what_it_likely_meant(data: dict[str, object], line: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_spec(data, "job.yaml")
    assert str(e.value) == f"job.yaml: {line}"


def test_explain_errors_takes_errors_not_a_validation() -> None:
    """A pure function of the errors, the model and the data: hand-built errors give the same line."""
    missing = {"type": "missing", "loc": ("total_steps",), "msg": "Field required", "input": {}}
    extra = {"type": "extra_forbidden", "loc": ("totalsteps",), "msg": "Extra inputs are not permitted"}
    errors: list[Any] = [missing, {**extra, "input": 1}]
    line = explain_errors(errors, JobSpec, {"totalsteps": 1})
    assert line == typo("totalsteps", "a job field", "total_steps")
    line = explain_errors(errors[:1], JobSpec, {})
    assert line == "field 'total_steps': Field required - add it to the job file"


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


SAVED: dict[str, Any] = {
    "recipe": "digits",
    "args": {"hidden": 32, "lr": 0.003},
    "seed": 0,
    "batch_size": 64,
    "amp": False,
    "total_steps": 100,
}


@pytest.mark.parametrize(
    ("new", "shape_args", "expected"),
    [
        ({}, {"hidden"}, []),
        ({"total_steps": 200, "storage": "/elsewhere"}, {"hidden"}, []),  # neither shape nor trajectory
        ({"args": {"hidden": 32, "lr": 0.001}}, {"hidden"}, [("args.lr", "trajectory", "0.003 -> 0.001")]),
        ({"args": {"hidden": 32, "lr": 0.001}}, None, [("args.lr", "shape", "0.003 -> 0.001")]),  # undeclared
        ({"args": {"hidden": 64, "lr": 0.003}}, {"hidden"}, [("args.hidden", "shape", "32 -> 64")]),
        ({"args": {"hidden": 32}}, {"hidden"}, [("args.lr", "trajectory", "0.003 -> (unset)")]),
        ({"seed": 1}, {"hidden"}, [("seed", "trajectory", "0 -> 1")]),
        ({"batch_size": 32}, {"hidden"}, [("batch_size", "trajectory", "64 -> 32")]),
        ({"amp": True}, {"hidden"}, [("amp", "trajectory", "false -> true")]),
        ({"recipe": "charlm"}, set(), [("recipe", "shape", '"digits" -> "charlm"')]),
        (  # shape first, then the rest in field order
            {"seed": 2, "args": {"hidden": 8, "lr": 1}},
            {"hidden"},
            [
                ("args.hidden", "shape", "32 -> 8"),
                ("args.lr", "trajectory", "0.003 -> 1"),
                ("seed", "trajectory", "0 -> 2"),
            ],
        ),
    ],
)
def test_spec_changes_split_shape_from_trajectory(
    new: dict[str, Any], shape_args: set[str] | None, expected: list[tuple[str, str, str]]
) -> None:
    changes = spec_changes(SAVED, {**SAVED, **new}, shape_args)
    assert [(c.field, c.kind, f"{c.old} -> {c.new}") for c in changes] == expected


def test_a_field_an_older_spec_lacks_is_not_a_change() -> None:
    old = {k: v for k, v in SAVED.items() if k != "amp"}
    assert spec_changes(old, {**SAVED, "amp": True}, {"hidden"}) == []


def test_resume_allow_changes_is_off_by_default_and_no_change_itself() -> None:
    a = JobSpec.model_validate(BASE)
    b = JobSpec.model_validate({**BASE, "resume": {"allow_changes": True}})
    assert not a.resume.allow_changes and b.resume.allow_changes
    assert spec_changes(a.model_dump(mode="json"), b.model_dump(mode="json")) == []
    assert a.shape_hash() == b.shape_hash()


def test_built_in_recipes_declare_their_shape_args() -> None:
    from spotrun.trainer.recipes import shape_args

    assert shape_args("digits") == {"hidden"}
    assert shape_args("charlm") == {"d_model", "n_layers", "n_heads", "seq_len"}
    assert shape_args("tests.fakes.nondeterministic_recipe:build") is None  # undeclared: all args


def test_storage_defaults_to_one_store_per_job() -> None:
    """Two jobs without a storage never share one (each would refuse the other's checkpoints)."""
    base = {"recipe": "digits", "total_steps": 5}
    a, b = (JobSpec.model_validate({**base, "name": n}) for n in ("a", "b"))
    assert (a.storage, b.storage) == ("checkpoints/a", "checkpoints/b")  # under SPOTRUN_HOME
    assert JobSpec.model_validate({**base, "name": "a", "storage": ""}).storage == "checkpoints/a"
    assert JobSpec.model_validate({**base, "name": "a", "storage": "s3://b/x"}).storage == "s3://b/x"


@pytest.mark.parametrize(
    ("storage", "refused"),
    [
        ("s3://b", "'s3://b' is a whole bucket: give the job a prefix of its own, s3://b/JOB"),
        ("s3://b/", "'s3://b/' is a whole bucket"),
        ("s3://b//", "'s3://b//' is a whole bucket"),
        ("s3:///x", "names no bucket"),
        ("s3://b/x", None),
        ("s3://b/team/x/", None),
    ],
)
def test_an_s3_storage_needs_a_prefix(storage: str, refused: str | None) -> None:
    """A whole bucket is refused: cleanup of stale uploads would abort every multipart upload in it."""
    base = {"name": "a", "recipe": "digits", "total_steps": 5, "storage": storage}
    if refused is None:
        assert JobSpec.model_validate(base).storage == storage
        return
    with pytest.raises(ConfigError) as e:
        parse_spec(base, "job.yaml")
    assert refused in str(e.value) and "\n" not in str(e.value)


LOOP = {"name": "j", "entrypoint": "mypkg.train:main", "total_steps": 10}
NEITHER = "name the code to run: add recipe: digits, charlm or package.module:function"


@pytest.mark.parametrize(
    ("data", "line"),
    [
        ({"name": "j", "total_steps": 10}, NEITHER),
        ({**BASE, "recipe": None}, NEITHER),
        ({**LOOP, "recipe": "digits"}, "recipe and entrypoint are exclusive (one way in per job): keep one"),
        (
            {**LOOP, "entrypoint": "mypkg.train"},
            "field 'entrypoint': 'mypkg.train' is not package.module:fun",
        ),
        (
            {**LOOP, "entrypoint": "train.py:main"},
            "field 'entrypoint': 'train.py:main' names a file: use the",
        ),
        (
            {**BASE, "shape_args": ["hidden"]},
            "shape_args is for an entrypoint job; a recipe declares its own",
        ),
        ({**LOOP, "shape_args": "hidden"}, "field 'shape_args'"),
        (
            {"name": "j", "total_steps": 1, "entrypiont": "a:b"},
            "field 'entrypiont' is not a job field: did you",
        ),
    ],
)
def test_a_job_names_its_code_one_way(data: dict[str, Any], line: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_spec(data, "job.yaml")
    assert str(e.value).startswith(f"job.yaml: {line}") and "\n" not in str(e.value)


def test_an_entrypoint_job() -> None:
    s = parse_spec({**LOOP, "args": {"hidden": 8, "lr": 0.1}, "shape_args": ["hidden"]})
    assert (s.recipe, s.entrypoint, s.shape_args) == (None, "mypkg.train:main", ["hidden"])
    assert parse_spec(LOOP).shape_args is None  # every arg is shape


# Computed before `entrypoint` existed: old checkpoints keep these hashes.
RECIPE_HASHES = [
    ({**BASE, "args": {"hidden": 32, "lr": 0.01}, "batch_size": 16}, None,
     "e8ba69abae4db3327417c37d0aa26c63aced85771bdcc283037d604f14a201c0"),
    ({**BASE, "args": {"hidden": 32, "lr": 0.01}, "batch_size": 16}, 2,
     "edfa77f620f9b4f2f6b1498b8d126ade17b0626614b8f7f1bac2c62d3eb8da10"),
    ({**BASE, "recipe": "pkg.mod:build", "distributed": {"nproc_per_node": 4}}, None,
     "812c9658454499ff0b87681be6b99eaf068afdd901ae73c074af9b6ef49f3e44"),
]  # fmt: skip  # a table: one case per line


@pytest.mark.parametrize(("data", "world_size", "digest"), RECIPE_HASHES)
def test_a_recipe_jobs_shape_hash_is_unchanged(
    data: dict[str, Any], world_size: int | None, digest: str
) -> None:
    assert parse_spec(data).shape_hash(world_size) == digest


def test_the_entrypoint_is_shape() -> None:
    a = parse_spec(LOOP)
    b = parse_spec({**LOOP, "entrypoint": "mypkg.train:main2"})
    assert "entrypoint" in a.shape_fields() and "entrypoint" not in parse_spec(BASE).shape_fields()
    assert a.shape_hash() != b.shape_hash()
    assert a.shape_hash() == parse_spec({**LOOP, "total_steps": 99, "seed": 3}).shape_hash()
    old, new = a.model_dump(mode="json"), b.model_dump(mode="json")
    changes = [(c.field, c.kind, str(c)) for c in spec_changes(old, new, None)]
    assert changes == [("entrypoint", "shape", 'entrypoint "mypkg.train:main" -> "mypkg.train:main2"')]
    recipe = parse_spec(BASE).model_dump(mode="json")  # a recipe's checkpoint resumed by a loop
    assert [(c.field, c.kind) for c in spec_changes(recipe, old, None)] == [
        ("recipe", "shape"),
        ("entrypoint", "shape"),
    ]
    saved = {k: v for k, v in recipe.items() if k != "entrypoint"}  # a checkpoint from before the field
    assert spec_changes(saved, recipe, None) == []


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({**LOOP, "shape_args": ["hidden"]}, frozenset({"hidden"})),
        ({**LOOP, "shape_args": []}, frozenset()),  # no arg shapes the state
        (LOOP, None),  # none declared: every arg
        (BASE, frozenset({"hidden"})),  # the recipe's own declaration
    ],
)
def test_spec_shape_args(data: dict[str, Any], expected: frozenset[str] | None) -> None:
    from spotrun.trainer.recipes.job_shape import spec_shape_args

    assert spec_shape_args(parse_spec(data)) == expected
