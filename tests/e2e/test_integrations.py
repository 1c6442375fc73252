"""docs/integrations.md's scripts, exactly as printed, run as `command:` jobs through the flow (as `spotrun
run` runs them) with three reclaims, one without notice: each ends with the same model and optimizer
bytes as the same job run once without interruption, a notice costs no step, and the documented
examples differ from the framework's plain ones by at most 5 lines."""

from __future__ import annotations

import difflib
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.test_flow import attempts, run_flow, schedule
from tests.trainer_runs import trainer
from trainer.checkpoint.format import step_dir
from trainer.spec.job import JobSpec

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "integrations.md"


def doc_block(starts: str) -> str:
    """The fenced block of docs/integrations.md that starts with `starts`."""
    blocks = re.findall(r"```(?:python|yaml)\n(.*?)```", DOC.read_text(), flags=re.S)
    return next(b for b in blocks if b.startswith(starts))


def changed_lines(a: str, b: str) -> int:
    """Lines added or changed from `a` to `b` (a changed line counts once)."""
    ops = difflib.SequenceMatcher(None, a.splitlines(), b.splitlines()).get_opcodes()
    return sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal")


def test_the_transformers_example_is_hfs_plain_script_and_four_lines() -> None:
    plain, ours = doc_block('"""hf_plain.py'), doc_block('"""hf_train.py')
    assert changed_lines(plain.split("\n", 1)[1], ours.split("\n", 1)[1]) <= 5


@pytest.fixture
def hf_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> JobSpec:
    script = tmp_path / "code" / "hf_train.py"
    script.parent.mkdir()
    script.write_text(doc_block('"""hf_train.py'))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")
    spec: dict[str, Any] = yaml.safe_load(doc_block("name: tiny-gpt2"))
    # this interpreter (the worker's PATH may find another python) and the script where the test wrote it
    spec["command"][:2] = [sys.executable, str(script)]
    return JobSpec.model_validate(spec | {"storage": str(tmp_path / "store"), "tracking": {"mlflow": False}})


def test_the_transformers_script_survives_three_reclaims_bitwise(
    prefect_api: str, home: Path, tmp_path: Path, hf_job: JobSpec
) -> None:
    # seconds of training after each attempt's first step; a notice leaves 10 s for the save
    state = run_flow(hf_job, schedule((1.5, True), (1.0, False), (1.5, True), notice_s=10))
    assert state.is_completed(), state.message
    rows = attempts(home)
    assert [r.outcome.value for r in rows] == ["preempted", "preempted", "preempted", "completed"]
    noticed = [r for r in rows[:3] if "without notice" not in r.cause]
    assert len(noticed) == 2
    for r in noticed:  # the stop step was saved and published (or training had ended): no step lost
        assert r.lost_steps == 0, r
    reference = tmp_path / "reference"
    reference.mkdir()
    (reference / "job.yaml").write_text(json.dumps(hf_job.model_dump(mode="json")))
    r = trainer(reference / "job.yaml", str(reference / "store"), reference, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    final = f"{step_dir(hf_job.total_steps)}/checkpoint-{hf_job.total_steps}"
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt"):
        ours = (Path(hf_job.storage) / final / name).read_bytes()
        assert ours == (reference / "store" / final / name).read_bytes(), name
