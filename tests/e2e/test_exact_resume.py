"""The signature test: runs killed at many points, resumed in new processes, end bitwise equal to an
uninterrupted run (parameters, optimizer state, every per-step loss)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.trainer_runs import assert_states_equal, losses, trainer, trainer_killed_after, write_spec
from trainer.catalog import fetch
from trainer.ckpt_format import step_dir
from trainer.exitcodes import ExitCode
from trainer.spec import S3Options
from trainer.storage import open_storage

# 28 batches per epoch, checkpoints every 7 steps. SIGKILL at 29 resumes from 28 (an epoch
# boundary), at 45 from 42 and at 52 from 49 (mid-epoch, twice within epoch 1).
# SIGTERM writes an emergency checkpoint at exactly the step it lands on.
CHAINS = {"sigkill": [29, 45, 52], "sigterm": [28, 45, 52]}
EXPECTED_RC = {"sigkill": -signal.SIGKILL, "sigterm": ExitCode.PREEMPTED}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("reference")
    r = trainer(write_spec(work / "job.yaml"), str(work / "store"), work)
    assert r.returncode == 0, r.stderr[-2000:]
    return work


def _final(storage_uri: str, work: Path, s3: S3Options | None = None) -> Path:
    return fetch(open_storage(storage_uri, s3), 100, work / "final")


def _run_chain(work: Path, storage: str, kind: str, spec: Path) -> None:
    for step in CHAINS[kind]:
        r = trainer(spec, storage, work, "--inject-fault", f"{kind}@{step}")
        assert r.returncode == EXPECTED_RC[kind], r.stderr[-2000:]
    r = trainer(spec, storage, work)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resuming from step" in r.stderr


def _assert_same_as(reference: Path, work: Path, final: Path) -> None:
    assert losses(work) == losses(reference)
    assert len(losses(work)) == 100
    assert_states_equal(final, reference / "store" / step_dir(100))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["sigkill", "sigterm"])
def test_killed_runs_resume_bitwise_local(
    reference: Path, tmp_path: Path, kind: str, num_workers: int
) -> None:
    spec = write_spec(tmp_path / "job.yaml", num_workers=num_workers)
    storage = str(tmp_path / "store")
    _run_chain(tmp_path, storage, kind, spec)
    _assert_same_as(reference, tmp_path, _final(storage, tmp_path))


@pytest.mark.parametrize(("kind", "num_workers"), [("sigkill", 0), ("sigterm", 2)])
def test_killed_runs_resume_bitwise_s3(
    reference: Path, tmp_path: Path, s3_bucket: tuple[str, str], kind: str, num_workers: int
) -> None:
    endpoint, bucket = s3_bucket
    spec = write_spec(tmp_path / "job.yaml", num_workers=num_workers, s3={"endpoint_url": endpoint})
    storage = f"s3://{bucket}/jobs/exact"
    _run_chain(tmp_path, storage, kind, spec)
    _assert_same_as(reference, tmp_path, _final(storage, tmp_path, S3Options(endpoint_url=endpoint)))


def test_kills_at_arbitrary_instants_resume_bitwise(reference: Path, tmp_path: Path) -> None:
    """SIGKILL by wall clock, not at step boundaries: with a checkpoint every 3 steps the kills land
    inside steps, snapshots, writes and uploads alike."""
    spec = write_spec(tmp_path / "job.yaml", checkpoint={"every_steps": 3, "keep": 2})
    storage = str(tmp_path / "store")
    for lines in (20, 31, 17):
        trainer_killed_after(spec, storage, tmp_path, lines, signal.SIGKILL)
    r = trainer(spec, storage, tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    _assert_same_as(reference, tmp_path, _final(storage, tmp_path))
