"""Bad input gets one clear error line, the CONFIG_ERROR exit code, and never loses a checkpoint."""

from __future__ import annotations

from pathlib import Path

from tests.trainer_runs import trainer, write_spec
from trainer.exitcodes import ExitCode


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if " ERROR " in line]


def _assert_one_clear_error(r: object, needle: str) -> None:
    rc, stderr = r.returncode, r.stderr  # type: ignore[attr-defined]
    assert rc == ExitCode.CONFIG_ERROR, stderr[-2000:]
    errors = _error_lines(stderr)
    assert len(errors) == 1 and needle in errors[0], stderr[-2000:]
    assert "Traceback" not in stderr


def test_malformed_yaml(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("name: x\nrecipe: digits\ntotal_steps: [3\n")
    _assert_one_clear_error(trainer(job, str(tmp_path / "s"), tmp_path), "is not valid YAML")


def test_unknown_field_names_the_field(tmp_path: Path) -> None:
    job = write_spec(tmp_path / "job.yaml", total_step=5)
    _assert_one_clear_error(trainer(job, str(tmp_path / "s"), tmp_path), "field 'total_step'")


def test_unknown_recipe(tmp_path: Path) -> None:
    job = write_spec(tmp_path / "job.yaml", recipe="nosuchrecipe")
    _assert_one_clear_error(trainer(job, str(tmp_path / "s"), tmp_path), "unknown recipe 'nosuchrecipe'")


def test_missing_bucket(tmp_path: Path, moto_server: str) -> None:
    job = write_spec(tmp_path / "job.yaml", s3={"endpoint_url": moto_server})
    r = trainer(job, "s3://spotrun-no-such-bucket/x", tmp_path)
    _assert_one_clear_error(r, "spotrun-no-such-bucket")


def test_checkpoint_of_another_model_is_refused_and_kept(tmp_path: Path) -> None:
    store = tmp_path / "store"
    first = trainer(write_spec(tmp_path / "a.yaml", total_steps=14), str(store), tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    before = sorted(p.relative_to(store) for p in store.rglob("*"))
    other = write_spec(tmp_path / "b.yaml", total_steps=28, args={"hidden": 48})
    _assert_one_clear_error(trainer(other, str(store), tmp_path), "different shape settings")
    assert sorted(p.relative_to(store) for p in store.rglob("*")) == before


def test_recipe_that_cannot_be_built_is_a_config_error_naming_the_args(tmp_path: Path) -> None:
    job = write_spec(tmp_path / "job.yaml", args={"hidden": -4})  # torch: negative dimension
    r = trainer(job, str(tmp_path / "s"), tmp_path)
    _assert_one_clear_error(r, "recipe 'digits' could not be built with args {")
    assert '"hidden": -4' in r.stderr and "RuntimeError: Trying to create tensor with negative" in r.stderr
    assert "fix args in the job file" in r.stderr
    job = write_spec(tmp_path / "job.yaml", args={"hidden": 8, "hiden": 8})
    _assert_one_clear_error(trainer(job, str(tmp_path / "s"), tmp_path), "unknown argument(s) ['hiden']")
