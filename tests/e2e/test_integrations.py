"""docs/integrations.md's Transformers script, exactly as printed, run as a `command:` job through the flow
(as `spotrun run` runs it) with three reclaims, one without notice: it ends with the same model and
optimizer bytes as the same job run once without interruption, a notice costs no step, and the
documented example differs from HF's plain one by at most 5 lines. The Lightning way in is in
test_integrations_lightning.py (a file of its own: the two spread over the suite's workers)."""

from __future__ import annotations

import difflib
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from spotrun.deployments.apply import allowed_by_defaults
from spotrun.trainer.spec.job import JobSpec
from tests.e2e.test_flow import attempts, reference_dir, run_flow, schedule
from tests.trainer_runs import trainer

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


# (script, job file, the job file's block in the docs, its deployment): each way in's shipped example
SHIPPED = [
    ("hf_train.py", "tiny-gpt2.yaml", "# A tiny GPT-2", "transformers-example"),
    ("pl_train.py", "tiny-mlp-lightning.yaml", "# A tiny MLP", "lightning-example"),
]


@pytest.mark.parametrize(("script", "job_file", "block", "name"), SHIPPED)
def test_the_shipped_jobs_and_deployments_are_the_documented_ones(
    script: str, job_file: str, block: str, name: str
) -> None:
    """deployments/jobs/ holds the docs' scripts and job files as printed, and each example deployment
    runs its job, so `spotrun deploy` allows exactly its command on this host."""
    assert (REPO / "deployments/jobs/scripts" / script).read_text() == doc_block(f'"""{script}')
    job = yaml.safe_load((REPO / "deployments/jobs" / job_file).read_text())
    assert job == yaml.safe_load(doc_block(block))
    doc = yaml.safe_load((REPO / "deployments/prefect.yaml").read_text())
    (deployment,) = [d for d in doc["deployments"] if d["name"] == name]
    assert deployment["parameters"]["job"] == job
    assert shlex.join(job["command"]) in allowed_by_defaults(doc).commands


def shipped_spec(job_file: str, tmp_path: Path, **fields: Any) -> JobSpec:
    """A shipped example job with its script's absolute path (the reference run starts in another
    directory) and a store of the test's own."""
    spec: dict[str, Any] = yaml.safe_load((REPO / "deployments/jobs" / job_file).read_text())
    spec["command"][1] = str(REPO / spec["command"][1])
    return JobSpec.model_validate(spec | {"storage": str(tmp_path / "store"), **fields})


@pytest.fixture
def hf_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> JobSpec:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")
    return shipped_spec("tiny-gpt2.yaml", tmp_path)


def test_the_transformers_script_survives_three_reclaims_bitwise(
    prefect_api: str, home: Path, tmp_path: Path, hf_job: JobSpec
) -> None:
    # seconds of training after each attempt's first step (the clock starts at the script's first
    # step, not at its imports); a notice leaves 10 s for the save. No prewarm: a noticed attempt then
    # saves and stops at once, where with a replacement coming it would train on through the notice
    # (at ~100 steps/s on a quiet machine, to the job's end: then it completes, and the three reclaims
    # this test is about never happen). 180 steps: each attempt makes 10-45 of them in its 0.3 s.
    hf_job = hf_job.model_copy(update={"total_steps": 180})
    provider = schedule((0.3, True), (0.3, False), (0.3, True), notice_s=10)
    state = run_flow(hf_job, provider.model_copy(update={"prewarm": False}))
    assert state.is_completed(), state.message
    rows = attempts(home)
    assert [r.outcome.value for r in rows] == ["preempted", "preempted", "preempted", "completed"]
    noticed = [r for r in rows[:3] if "without notice" not in r.cause]
    assert len(noticed) == 2
    for r in noticed:  # the stop step was saved and published (or training had ended): no step lost
        assert r.lost_steps == 0, r
    # HF logs a mean every 5 steps: where a resume replayed whole logging windows they were compared,
    # bit for bit; a window a notice's save cut short is never compared (no false mismatch); a resume
    # with nothing to compare says so (`unchecked`)
    checks = [r.extra.get("resume_check", {}).get("verdict") for r in rows]
    assert checks[0] is None and set(checks[1:]) <= {"exact", "unchecked"}, checks  # each resume has one
    # one MLflow run: each logged loss once (a replayed logging step is not sent again), the model
    from mlflow import MlflowClient  # here: the module takes seconds to import

    client = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name(hf_job.name).experiment_id])
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(h.step for h in history) == list(range(5, hf_job.total_steps + 1, 5))
    assert run.data.tags["spotrun.attempts"] == "4" and run.info.status == "FINISHED"
    assert run.data.tags["spotrun.resume_fidelity"] == (
        "exact" if set(checks[1:]) == {"exact"} else "unchecked"
    )
    assert client.get_registered_model(hf_job.name).latest_versions

    final = reference_dir(hf_job, tmp_path, timeout=300) / f"checkpoint-{hf_job.total_steps}"
    names = ("model.safetensors", "optimizer.pt", "scheduler.pt")
    ours = {n: (Path(hf_job.storage) / final.parent.name / final.name / n).read_bytes() for n in names}
    assert ours == {n: (final / n).read_bytes() for n in names}

    # the newest checkpoint damaged in the store (and the job not yet finished): the next start passes
    # over it to the one before, trains the last steps again and ends with the same bytes
    store = final.parent.parent
    damaged = final / "model.safetensors"
    body = bytearray(damaged.read_bytes())
    body[-1] ^= 0xFF
    damaged.write_bytes(bytes(body))
    (store / "COMPLETED.json").unlink()
    r = trainer(store.parent / "job.yaml", str(store), store.parent, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    said = f"resuming from step {hf_job.total_steps - 10} of "
    assert said in r.stderr and f"rejected step {hf_job.total_steps}:" in r.stderr, r.stderr[-2000:]
    assert {n: (final / n).read_bytes() for n in names} == ours
