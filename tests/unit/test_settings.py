"""SPOTRUN_HOME and storage resolution: one home per user, relative storage under it, never the cwd."""

from __future__ import annotations

from pathlib import Path

import pytest

from spotrun.tasks.settings import Settings, spotrun_home
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import check_local_path, resolve_uri


def test_home_defaults_to_the_users_not_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert spotrun_home({}) == Path("~/.spotrun").expanduser().resolve()
    assert spotrun_home({"SPOTRUN_HOME": "rel"}) == tmp_path / "rel"  # taken once, at the edge
    assert spotrun_home({"SPOTRUN_HOME": " "}) == spotrun_home({})


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("checkpoints/digits", "/home/u/.spotrun/checkpoints/digits"),
        ("file://checkpoints/x", "/home/u/.spotrun/checkpoints/x"),
        ("/data/ckpt", "/data/ckpt"),
        ("file:///data/ckpt", "/data/ckpt"),
        ("s3://bucket/prefix", "s3://bucket/prefix"),
    ],
)
def test_relative_storage_resolves_under_the_home(uri: str, expected: str) -> None:
    assert resolve_uri(uri, Path("/home/u/.spotrun")) == expected


def test_settings_resolve_gives_the_trainer_an_absolute_uri(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings.from_env({"SPOTRUN_HOME": str(tmp_path / "home")})
    job = JobSpec.model_validate({"name": "j", "recipe": "digits", "total_steps": 5, "storage": "ckpt/j"})
    for cwd in (tmp_path, tmp_path / "home"):  # the same job from two directories: one location
        cwd.mkdir(exist_ok=True)
        monkeypatch.chdir(cwd)
        assert settings.resolve(job).storage == str(tmp_path / "home" / "ckpt" / "j")
    absolute = job.model_copy(update={"storage": "/data/x"})
    assert settings.resolve(absolute) is absolute


def test_a_storage_path_that_is_a_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=f"storage {tmp_path / 'f'} is a file"):
        check_local_path(str(tmp_path / "f"))
    with pytest.raises(ConfigError, match=f"is under {tmp_path / 'f'}, which is a file"):
        check_local_path(f"file://{tmp_path / 'f' / 'sub'}")
    check_local_path(str(tmp_path / "new" / "dir"))  # absent: created later
    check_local_path("s3://b/p")
