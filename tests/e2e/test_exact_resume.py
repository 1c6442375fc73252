"""The signature test: runs killed at many points, resumed in new processes, end bitwise equal to an
uninterrupted run (parameters, optimizer state, every per-step loss)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from spotrun.trainer.checkpoint.catalog import fetch
from spotrun.trainer.checkpoint.format import step_dir
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.storage import open_storage
from spotrun.trainer.storage.options import S3Options
from tests.trainer_runs import assert_states_equal, losses, trainer, trainer_killed_after, write_spec

# 28 batches per epoch, checkpoints every 7 steps. Each chain mixes both kinds of death:
#   sigkill@29 resumes from 28 (an epoch boundary), sigkill@45 from 42 (mid-epoch);
#   sigterm writes an emergency checkpoint at exactly its step (28: a boundary, 45 and 52: mid-epoch).
# 45 and 52 fall in the same epoch (28-55): two interruptions within one epoch.
CHAINS = {
    "kill-term-kill": [("sigkill", 29), ("sigterm", 45), ("sigkill", 52)],
    "term-kill-term": [("sigterm", 28), ("sigkill", 45), ("sigterm", 52)],
}
EXPECTED_RC = {"sigkill": -signal.SIGKILL, "sigterm": ExitCode.PREEMPTED}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("reference")
    r = trainer(write_spec(work / "job.yaml"), str(work / "store"), work)
    assert r.returncode == 0, r.stderr[-2000:]
    return work


def _final(storage_uri: str, work: Path, s3: S3Options | None = None) -> Path:
    return fetch(open_storage(storage_uri, s3), 100, work / "final")


def _run_chain(work: Path, storage: str, chain: str, spec: Path) -> None:
    for kind, step in CHAINS[chain]:
        r = trainer(spec, storage, work, "--inject-fault", f"{kind}@{step}")
        assert r.returncode == EXPECTED_RC[kind], r.stderr[-2000:]
    r = trainer(spec, storage, work)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resuming from step" in r.stderr


def _assert_same_as(reference: Path, work: Path, final: Path) -> None:
    assert losses(work) == losses(reference)
    assert len(losses(work)) == 100
    assert_states_equal(final, reference / "store" / step_dir(100))


@pytest.mark.parametrize(("chain", "num_workers"), [("kill-term-kill", 0), ("term-kill-term", 2)])
def test_killed_runs_resume_bitwise_local(
    reference: Path, tmp_path: Path, chain: str, num_workers: int
) -> None:
    spec = write_spec(tmp_path / "job.yaml", num_workers=num_workers)
    storage = str(tmp_path / "store")
    _run_chain(tmp_path, storage, chain, spec)
    _assert_same_as(reference, tmp_path, _final(storage, tmp_path))


@pytest.mark.parametrize(("chain", "num_workers"), [("kill-term-kill", 2)])
def test_killed_runs_resume_bitwise_s3(
    reference: Path, tmp_path: Path, s3_bucket: tuple[str, str], chain: str, num_workers: int
) -> None:
    endpoint, bucket = s3_bucket
    spec = write_spec(tmp_path / "job.yaml", num_workers=num_workers, s3={"endpoint_url": endpoint})
    storage = f"s3://{bucket}/jobs/exact"
    _run_chain(tmp_path, storage, chain, spec)
    _assert_same_as(reference, tmp_path, _final(storage, tmp_path, S3Options(endpoint_url=endpoint)))


def test_kills_at_arbitrary_instants_resume_bitwise(reference: Path, tmp_path: Path) -> None:
    """SIGKILL by wall clock, not at step boundaries: with a checkpoint every 3 steps the kills land
    inside steps, snapshots, writes and uploads alike."""
    spec = write_spec(tmp_path / "job.yaml", checkpoint={"every_steps": 3, "keep": 2})
    storage = str(tmp_path / "store")
    for lines in (20, 31, 17):
        trainer_killed_after(spec, storage, tmp_path, lines, sig=signal.SIGKILL)
    r = trainer(spec, storage, tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    _assert_same_as(reference, tmp_path, _final(storage, tmp_path))


def test_sigterm_to_the_process_group_with_loader_workers(reference: Path, tmp_path: Path) -> None:
    """A container stop signals every process: loader workers must survive it (they leave the group),
    so the trainer finishes its step, checkpoints and exits PREEMPTED instead of dying with them."""
    spec = write_spec(tmp_path / "job.yaml", num_workers=2)
    storage = str(tmp_path / "store")
    rc = trainer_killed_after(spec, storage, tmp_path, 40, sig=signal.SIGTERM, group=True)
    assert rc == ExitCode.PREEMPTED
    r = trainer(spec, storage, tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    _assert_same_as(reference, tmp_path, _final(storage, tmp_path))
