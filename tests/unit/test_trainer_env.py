"""Which of the controller's variables reach a local trainer (tasks/providers/trainer_env.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from spotrun.tasks.providers.aws.launch import build_user_data
from spotrun.tasks.providers.trainer_env import passes, trainer_env
from spotrun.trainer.spec.job import EnvOptions


@pytest.mark.parametrize(
    ("name", "named", "expected"),
    [
        ("PATH", (), True),
        ("PYTHONPATH", (), True),
        ("VIRTUAL_ENV", (), True),
        ("HF_HOME", (), True),
        ("HF_HUB_OFFLINE", (), True),
        ("CUDA_VISIBLE_DEVICES", (), True),
        ("OMP_NUM_THREADS", (), True),
        ("LD_LIBRARY_PATH", (), True),
        ("SPOTRUN_MANIFEST_KEY", (), True),  # the trainer signs
        ("SPOTRUN_HOME", (), True),
        ("AWS_PROFILE", (), True),  # a local trainer's S3 access: a profile, not the keys
        ("HF_TOKEN", (), False),
        ("HF_TOKEN", ("HF_TOKEN",), True),  # named by the job's env.pass
        ("WANDB_API_KEY", (), False),
        ("PREFECT_API_AUTH_STRING", (), False),
        ("PREFECT_API_AUTH_STRING", ("PREFECT_API_AUTH_STRING",), False),  # never, even when named
        ("PREFECT_API_URL", (), False),
        ("SPOTRUN_DATABASE_URL", ("SPOTRUN_DATABASE_URL",), False),
        ("HISTORY_DATABASE_URL", ("HISTORY_DATABASE_URL",), False),
        ("SPOTRUN_SLACK_TOKEN", (), False),
        ("SLACK_BOT_TOKEN", ("SLACK_BOT_TOKEN",), False),
        ("AWS_ACCESS_KEY_ID", (), False),
        ("AWS_SECRET_ACCESS_KEY", ("AWS_SECRET_ACCESS_KEY",), False),
        ("AWS_SESSION_TOKEN", (), False),
        ("PGPASSWORD", (), False),
    ],
)
def test_what_passes(name: str, named: tuple[str, ...], expected: bool) -> None:
    assert passes(name, frozenset(named)) is expected


def test_set_then_spotruns_own_win() -> None:
    environ = {"PATH": "/bin", "HF_HOME": "/hf", "SLACK_BOT_TOKEN": "x", "OTHER": "o", "NAMED": "n"}
    env = EnvOptions.model_validate({"pass": ["NAMED"], "set": {"HF_HOME": "/job/hf", "X": "1"}})
    got = trainer_env(environ, env, {"X": "2"})
    assert got == {"PATH": "/bin", "HF_HOME": "/job/hf", "NAMED": "n", "X": "2"}


def test_ec2_user_data_exports_the_jobs_env_set_quoted(tmp_path: Path) -> None:
    """The user data run by bash with a stand-in `python` that prints what it was given."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "python").write_text(
        '#!/bin/bash\n[ "$2" = -c ] && exit 0\necho "WANDB_PROJECT=$WANDB_PROJECT"\necho "ODD=$ODD"\n'
    )
    (stubs / "python").chmod(0o755)
    spec = "name: d\nrecipe: digits\ntotal_steps: 1\n"
    env = {"WANDB_PROJECT": "nightly", "ODD": "it's $HOME; `x`"}
    script = build_user_data(
        spec, [], python="python", workdir=str(tmp_path / "w"), job="d", attempt=1, env=env
    )
    boot = {"PATH": f"{stubs}:/usr/bin:/bin", "SPOTRUN_WORKER_ID": "i-1", "SPOTRUN_TRAINER_USER": ""}
    out = subprocess.run(["bash"], input=script, text=True, capture_output=True, env=boot, check=True)
    assert out.stdout == "WANDB_PROJECT=nightly\nODD=it's $HOME; `x`\n"


def test_ec2_user_data_reads_the_manifest_key_from_the_instances_file(tmp_path: Path) -> None:
    """The key is read on the instance, before the switch to the trainer's user; never in user data."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "python").write_text('#!/bin/bash\n[ "$2" = -c ] && exit 0\necho "KEY=$SPOTRUN_MANIFEST_KEY"\n')
    (stubs / "python").chmod(0o755)
    (tmp_path / "key").write_text("s3cret\n")
    script = build_user_data(
        "name: d\n",
        [],
        python="python",
        workdir=str(tmp_path / "w"),
        job="d",
        attempt=1,
        manifest_key_file=str(tmp_path / "key"),
    )
    assert "s3cret" not in script
    boot = {"PATH": f"{stubs}:/usr/bin:/bin", "SPOTRUN_WORKER_ID": "i-1", "SPOTRUN_TRAINER_USER": ""}
    out = subprocess.run(["bash"], input=script, text=True, capture_output=True, env=boot, check=True)
    assert out.stdout == "KEY=s3cret\n"
