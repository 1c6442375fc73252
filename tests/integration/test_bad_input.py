"""Bad input gets one clear error line, the CONFIG_ERROR exit code, and never loses a checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spotrun.trainer.exitcodes import ExitCode
from tests.trainer_runs import REPO, trainer, write_spec


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
    job = write_spec(tmp_path / "job.yaml", args={"hidden": -4})  # the recipe's own check (ValueError)
    r = trainer(job, str(tmp_path / "s"), tmp_path)
    _assert_one_clear_error(r, "recipe 'digits' could not be built with args {")
    assert '"hidden": -4' in r.stderr and "ValueError: hidden -4 must be >= 1" in r.stderr
    assert "fix args in the job file" in r.stderr
    job = write_spec(tmp_path / "job.yaml", args={"hiden": 8})  # beside the spec's own `hidden`
    r = trainer(job, str(tmp_path / "s"), tmp_path)
    _assert_one_clear_error(r, "recipe 'digits' has no argument 'hiden': digits takes ['dropout', ")


def test_storage_that_refuses_writes_is_not_retried(tmp_path: Path) -> None:
    """sysfs refuses new files (EACCES), even to root: a read-only or foreign store, told in one line."""
    r = trainer(write_spec(tmp_path / "job.yaml"), "/sys/kernel", tmp_path)
    _assert_one_clear_error(r, "in storage /sys/kernel: permission denied")


def test_storage_path_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("keep me\n")
    r = trainer(write_spec(tmp_path / "job.yaml"), str(tmp_path / "afile"), tmp_path)
    _assert_one_clear_error(r, f"storage {tmp_path / 'afile'} is a file, not a directory")
    assert (tmp_path / "afile").read_text() == "keep me\n"


def test_s3_endpoint_down_is_one_line_and_retryable(tmp_path: Path) -> None:
    job = write_spec(tmp_path / "job.yaml", s3={"endpoint_url": "http://127.0.0.1:9"})  # discard: refused
    creds = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1"}
    r = trainer(job, "s3://spotrun-down/x", tmp_path, env=creds)
    assert r.returncode == ExitCode.CRASHED and ExitCode.CRASHED.retryable, r.stderr[-2000:]
    errors = _error_lines(r.stderr)
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "http://127.0.0.1:9" in errors[0] and "retried from the last durable checkpoint" in errors[0]


# ---- the command line: every bad input is one line on stderr, exit 2, and nothing is touched ----

JOB = "name: bad\nrecipe: {recipe}\ntotal_steps: 5\nstorage: {storage}\n"
MYSQL = "mysql://u:secret@db.example/history"
CLI_CASES: list[tuple[str, list[str], dict[str, str], str]] = [
    # (id, argv, environment, what the one line must say); {t}: the test's directory
    ("unknown recipe", ["run", "{t}/nosuch.yaml"], {}, "unknown recipe 'nosuchrecipe'"),
    ("misspelt recipe arg", ["run", "{t}/typo.yaml"], {},
     "recipe 'digits' has no argument 'hiden': did you mean 'hidden'? (fix args in the job file)"),
    ("storage is a file", ["run", "{t}/job.yaml", "--storage", "{t}/afile"], {}, "{t}/afile is a file"),
    ("a hook with a timeout of 0", ["run", "{t}/hooked.yaml"], {},
     "field 'hooks.timeout_s': timeout_s 0 is not positive: give the seconds a hook may run, e.g. 60"),
    ("relative storage under a file", ["run", "{t}/under.yaml"], {}, "under {t}/home/afile, which is a file"),
    ("run with a mysql URL", ["run", "{t}/job.yaml"], {"SPOTRUN_DATABASE_URL": MYSQL},
     "mysql is not supported"),
    ("mysql URL", ["history"], {"SPOTRUN_DATABASE_URL": MYSQL}, "mysql is not supported"),
    ("password hidden", ["history"], {"SPOTRUN_DATABASE_URL": MYSQL}, "u:***@db.example"),
    ("sqlite file that is no database", ["history"], {"SPOTRUN_DATABASE_URL": "sqlite:///{t}/notdb.db"},
     "{t}/notdb.db is not a SQLite database"),
    ("run with a non-database sqlite", ["run", "{t}/job.yaml"],
     {"SPOTRUN_DATABASE_URL": "sqlite:///{t}/notdb.db"}, "is not a SQLite database"),
    ("port that is not a number", ["history"], {"SPOTRUN_DATABASE_URL": "postgresql://u@h:notaport/db"},
     "its port is not a number"),
    ("report with a bad port", ["report", "bad"], {"SPOTRUN_DATABASE_URL": "postgresql://u@h:notaport/db"},
     "its port is not a number"),
    ("old keys without a signing key", ["run", "{t}/job.yaml"], {"SPOTRUN_MANIFEST_KEYS_OLD": "k"},
     "SPOTRUN_MANIFEST_KEYS_OLD is set but SPOTRUN_MANIFEST_KEY is not"),
    ("list a file", ["checkpoints", "list", "{t}/afile"], {}, "{t}/afile is a file"),
    ("verify a missing directory", ["checkpoints", "verify", "{t}/missing"], {},
     "storage directory {t}/missing does not exist"),
    ("verify --spec whose storage is missing", ["checkpoints", "verify", "--spec", "{t}/job.yaml"], {},
     "{t}/home/ckpt does not exist"),
]  # fmt: skip  # one case per line: a table


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(("argv", "env", "says"), [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input_is_one_line_exit_2_and_touches_nothing(
    tmp_path: Path, argv: list[str], env: dict[str, str], says: str
) -> None:
    t = str(tmp_path)
    (tmp_path / "home").mkdir()
    (tmp_path / "afile").write_text("a file, not a directory\n")
    (tmp_path / "home" / "afile").write_text("also a file\n")
    (tmp_path / "notdb.db").write_text("not a database\n")
    (tmp_path / "job.yaml").write_text(JOB.format(recipe="digits", storage="ckpt"))
    (tmp_path / "nosuch.yaml").write_text(JOB.format(recipe="nosuchrecipe", storage="ckpt"))
    (tmp_path / "typo.yaml").write_text(JOB.format(recipe="digits", storage="ckpt") + "args: {hiden: 8}\n")
    (tmp_path / "under.yaml").write_text(JOB.format(recipe="digits", storage="afile/ckpt"))
    hooked = JOB.format(recipe="digits", storage="ckpt") + "hooks: {on_stop: [python, x.py], timeout_s: 0}\n"
    (tmp_path / "hooked.yaml").write_text(hooked)
    before = _tree(tmp_path)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTRUN_", "PREFECT_"))}
    # a case that got past its check would fail on this API rather than start a server
    full_env |= {
        "PYTHONPATH": str(REPO),
        "SPOTRUN_HOME": f"{t}/home",
        "PREFECT_API_URL": "http://127.0.0.1:9/api",
    }
    full_env |= {k: v.format(t=t) for k, v in env.items()}
    cmd = [sys.executable, "-m", "spotrun.cli", *(a.format(t=t) for a in argv)]
    r = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2, r.stdout[-1000:] + r.stderr[-2000:]
    assert r.stderr.startswith("spotrun: error: ") and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert says.format(t=t) in r.stderr, r.stderr
    assert "secret" not in r.stderr
    assert _tree(tmp_path) == before  # nothing deleted, changed or created


@pytest.mark.parametrize(
    ("hooks", "needle"),
    [
        ({"on_stop": []}, "field 'hooks.on_stop': the hook's command is empty"),
        ({"timeout_s": 0}, "not positive"),
    ],
)
def test_bad_hooks_are_one_line_before_training(
    tmp_path: Path, hooks: dict[str, object], needle: str
) -> None:
    job = write_spec(tmp_path / "job.yaml", hooks=hooks)
    _assert_one_clear_error(trainer(job, str(tmp_path / "s"), tmp_path), needle)
    assert not (tmp_path / "s").exists()  # refused before any storage or worker
