"""Before a run, one read of the job's storage: a finished job is not run again (no server, no flow run,
no attempt row), another finished job's storage is refused, and a storage that cannot be read is one
line, exit 2. The trainer refuses another job's finished storage the same way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spotrun.tasks.control.loop import PlainSink, run_job
from spotrun.tasks.decisions.policy import RetryPolicy
from spotrun.tasks.settings import Settings
from spotrun.trainer.checkpoint.completion import completed_for, mark_completed
from spotrun.trainer.checkpoint.format import COMPLETED
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.spec.job import JobSpec, parse_spec
from spotrun.trainer.storage import LocalStorage
from tests.fakes.provider import FakeAttempt, FakeProvider
from tests.trainer_runs import REPO, trainer, write_spec

BASE: dict[str, Any] = {
    "name": "done",
    "recipe": "digits",
    "total_steps": 5,
    "storage": "ckpt",
    "args": {"hidden": 32},
}


def _spec(**over: Any) -> JobSpec:
    return parse_spec({**BASE, **over})


@pytest.mark.parametrize(
    ("marker", "spec", "expect"),
    [
        (None, _spec(), None),  # never finished
        (5, _spec(), 5),  # finished: the same job
        (5, _spec(total_steps=3), 5),  # finished past a lower total
        (5, _spec(total_steps=9), None),  # a raised total trains on (its resume checks the model)
        (5, _spec(args={"hidden": 64}), "(args.hidden 32 -> 64)"),
        (5, _spec(seed=1), "(seed 0 -> 1)"),
        (5, _spec(name="other"), "(name done -> other)"),
        (5, _spec(recipe="charlm", args={}), 'recipe "digits" -> "charlm"'),
        (5, _spec(log_every=7, storage="elsewhere"), 5),  # what does not make the job another one
    ],
)
def test_completed_for(tmp_path: Path, marker: int | None, spec: JobSpec, expect: int | str | None) -> None:
    store = LocalStorage(tmp_path)
    if marker is not None:
        mark_completed(store, _spec(), marker)
    if isinstance(expect, str):
        with pytest.raises(ConfigError, match=r"holds job done completed at step 5 with other settings") as e:
            completed_for(store, spec)
        assert expect in str(e.value) and "give this job a storage of its own" in str(e.value)
    else:
        assert completed_for(store, spec) == expect


def test_a_marker_without_the_spec_is_trusted_and_a_malformed_one_ignored(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    (tmp_path / COMPLETED).write_text('{"job": "done", "step": 5, "spec_hash": "x"}')  # before the spec
    assert completed_for(store, _spec(args={"hidden": 64})) == 5
    (tmp_path / COMPLETED).write_text("{not json")
    assert completed_for(store, _spec()) is None


def _cli(tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTRUN_", "PREFECT_", "AWS_"))}
    # a run that got past the storage check would fail on this API rather than start a server
    full_env |= {
        "PYTHONPATH": str(REPO),
        "SPOTRUN_HOME": str(tmp_path / "home"),
        "PREFECT_API_URL": "http://127.0.0.1:9/api",
        **(env or {}),
    }
    cmd = [sys.executable, "-m", "spotrun.cli", *argv]
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=120, cwd=tmp_path)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_spotrun_run_of_a_finished_job_says_so_and_runs_nothing(tmp_path: Path) -> None:
    (tmp_path / "home" / "ckpt").mkdir(parents=True)
    mark_completed(LocalStorage(tmp_path / "home" / "ckpt"), _spec(), 5)
    (tmp_path / "job.yaml").write_text(_spec().model_dump_json())
    (tmp_path / "other.yaml").write_text(_spec(args={"hidden": 64}).model_dump_json())
    before = _tree(tmp_path)
    r = _cli(tmp_path, "run", "job.yaml")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"job done already completed at step 5 in {tmp_path}/home/ckpt: nothing to run" in r.stdout
    assert "Prefect server" not in r.stdout and r.stderr == ""
    r = _cli(tmp_path, "run", "other.yaml")
    assert r.returncode == 2 and r.stdout == "", r.stderr[-2000:]
    assert r.stderr.startswith("spotrun: error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "holds job done completed at step 5 with other settings (args.hidden 32 -> 64)" in r.stderr
    assert _tree(tmp_path) == before  # no history database, no flow run's files, the marker as it was


def test_spotrun_run_against_an_s3_endpoint_that_is_down_is_one_error_line(tmp_path: Path) -> None:
    spec = {**BASE, "storage": "s3://spotrun-down/job", "s3": {"endpoint_url": "http://127.0.0.1:9"}}
    (tmp_path / "job.yaml").write_text(parse_spec(spec).model_dump_json())
    creds = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1"}
    r = _cli(tmp_path, "run", "job.yaml", env=creds)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("spotrun: error: ")]
    assert len(errors) == 1 and "cannot be reached" in errors[0] and "http://127.0.0.1:9" in errors[0]
    assert "check the URI, s3.endpoint_url and the network" in errors[0]


def test_the_trainer_refuses_another_jobs_finished_storage(tmp_path: Path) -> None:
    store = tmp_path / "store"
    job = write_spec(tmp_path / "job.yaml", total_steps=5)
    mark_completed(LocalStorage(store), _spec(name="someone-else"), 5)
    r = trainer(job, str(store), tmp_path)
    assert r.returncode == ExitCode.CONFIG_ERROR, r.stderr[-2000:]
    assert "holds job someone-else completed at step 5 with other settings" in r.stderr
    assert "Traceback" not in r.stderr


def test_the_control_loop_runs_no_attempt_for_a_finished_job(tmp_path: Path) -> None:
    settings = Settings.from_env({"SPOTRUN_HOME": str(tmp_path / "home")})
    job = settings.resolve(_spec())
    mark_completed(LocalStorage(Path(job.storage)), job, 5)
    provider = FakeProvider()
    result = run_job(job, provider, RetryPolicy(), PlainSink(), settings=settings)
    assert result.completed, result.message
    assert result.message == f"already completed at step 5 in {job.storage}: nothing to run"
    assert result.summary.attempts == 0 and provider.provisioned == []


def test_the_control_loop_outlives_a_storage_that_is_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its own reads (COMPLETED.json, the integrity check) fail: each is a warning, and the policy
    decides on the attempts' endings (the trainers failed on the same storage), with no traceback."""
    for k, v in {
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "y",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    settings = Settings.from_env({"SPOTRUN_HOME": str(tmp_path / "home")})
    job = settings.resolve(
        _spec(
            storage="s3://spotrun-down/job",
            s3={"endpoint_url": "http://127.0.0.1:9"},
            tracking={"mlflow": False},
        )
    )
    crash = FakeAttempt(until=3, exit_code=ExitCode.CRASHED, error="TransientStorageError: down")
    sink = PlainSink()
    result = run_job(
        job,
        FakeProvider([crash, crash]),
        RetryPolicy(max_errors=2, backoff_base_s=0.0),
        sink,
        settings=settings,
        sleep=lambda s: None,
    )
    assert not result.completed and result.summary.attempts == 2, result.message
    assert result.message == "same error at step 3 twice: TransientStorageError: down", result.message


def test_a_flow_on_another_finished_jobs_storage_fails_with_the_trainers_refusal(tmp_path: Path) -> None:
    """The flow's own check only warns; the trainer refuses (CONFIG_ERROR), and the other job's marker
    does not make its attempt 'completed'."""
    settings = Settings.from_env({"SPOTRUN_HOME": str(tmp_path / "home")})
    job = settings.resolve(_spec())
    mark_completed(LocalStorage(Path(job.storage)), _spec(args={"hidden": 64}), 5)
    refusal = "ConfigError: holds job done completed at step 5 with other settings"
    attempt = FakeAttempt(until=0, exit_code=ExitCode.CONFIG_ERROR, error=refusal)
    result = run_job(job, FakeProvider([attempt]), RetryPolicy(), PlainSink(), settings=settings)
    assert not result.completed and result.summary.attempts == 1, result.message
    assert "holds job done completed at step 5" in result.message
