"""`spotrun init`: the files it writes are a valid job and a module that trains, resumes and finishes under
the trainer; it never overwrites."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from spotrun.cli import main
from spotrun.init_cmd import KINDS, files_for
from spotrun.trainer.checkpoint.format import step_dir
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.spec.job import JobSpec


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_is_a_valid_job(kind: str) -> None:
    files = files_for(kind, "mine")
    spec = JobSpec.model_validate(yaml.safe_load(files["job.yaml"]))
    assert spec.name == "mine" and spec.storage == "checkpoints/mine"  # under $SPOTRUN_HOME
    named = spec.entrypoint or spec.recipe or spec.command[1]  # type: ignore[index]
    assert named.split(":")[0].removesuffix(".py") + ".py" in {*files, "train.py"}


@pytest.mark.parametrize("kind", ["loop", "recipe"])
def test_the_starter_trains_stops_and_resumes(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written by `spotrun init`, run by the trainer from that directory: 60 steps, stopped at 30 by
    --max-steps and resumed from its checkpoint there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPOTRUN_HOME", str(tmp_path / "home"))
    assert main(["init", "--kind", kind]) == 0
    job = yaml.safe_load((tmp_path / "job.yaml").read_text())
    job |= {"total_steps": 60, "checkpoint": {"every_steps": 30, "keep": 2}, "tracking": {"mlflow": False}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    trainer = [sys.executable, "-m", "spotrun.trainer", "--config", "job.yaml"]
    store = tmp_path / "home" / "checkpoints" / "my-job"
    for more, step, code in (["--max-steps", "30"], 30, ExitCode.STOPPED), ([], 60, ExitCode.COMPLETED):
        done = subprocess.run([*trainer, *more], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == code, done.stderr[-3000:]
        assert (store / step_dir(step)).is_dir(), sorted(p.name for p in store.iterdir())
    assert "resuming from step 30" in done.stderr


def test_init_never_overwrites(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPOTRUN_HOME", str(tmp_path / "home"))
    (tmp_path / "train.py").write_text("mine\n")
    assert main(["init"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spotrun: error: train.py already exists in ") and err.count("\n") == 1
    assert (tmp_path / "train.py").read_text() == "mine\n" and not (tmp_path / "job.yaml").exists()
