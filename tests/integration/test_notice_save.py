"""A real `python -m spotrun.trainer` against stand-in metadata services: a notice mid-training ends in an
emergency checkpoint at exactly the step it stopped at (0 lost steps), exit PREEMPTED; a notice
whose deadline is too close skips the save and says why; the storage heartbeat holds the exit."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from spotrun.trainer.checkpoint.catalog import list_checkpoints, read_latest
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.storage import LocalStorage
from spotrun.trainer.telemetry.heartbeat import read_heartbeat
from spotrun.trainer.telemetry.status import parse_status_line
from tests.fakes.imds import FakeAzureEvents, FakeGCPMetadata, FakeIMDS, FakeServer
from tests.trainer_runs import REPO, write_spec


@dataclass
class Run:
    rc: int
    records: list[dict[str, Any]]
    stderr: str
    storage: LocalStorage

    def last(self, kind: str) -> dict[str, Any]:
        return [r for r in self.records if r["kind"] == kind][-1]

    def durable_steps(self) -> list[int]:
        return [r["step"] for r in self.records if r["kind"] == "durable"]


def train_until_notice(
    work: Path,
    fake: FakeServer,
    notice: str,
    trigger: Callable[[], object],
    after_steps: int,
    *extra: str,
    margin_s: float = 5.0,
    fields: dict[str, Any] | None = None,
) -> Run:
    """Start a long digits run watching `fake`, call `trigger` once `after_steps` steps are done.
    `fields`: more of the job file (hooks)."""
    spec = write_spec(
        work / "job.yaml",
        total_steps=100_000,
        log_every=100_000,
        checkpoint={"every_steps": 20, "keep": 2},
        preemption={"notice": notice, "poll_s": 0.05, "save_margin_s": margin_s},
        **(fields or {}),
    )
    metrics, out, err = work / "metrics.jsonl", work / "stdout", work / "stderr"
    cmd = [sys.executable, "-m", "spotrun.trainer", "--config", str(spec), "--storage", str(work / "store")]
    cmd += ["--metrics", str(metrics), "--cache", str(work / "cache"), *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPOTRUN_IMDS_ENDPOINT": fake.endpoint}
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=fo, stderr=fe)
        deadline = time.monotonic() + 60
        while _lines(metrics) < after_steps and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        trigger()
        rc = proc.wait(timeout=60)
    records = [r.to_json() for line in out.read_text().splitlines() if (r := parse_status_line(line))]
    return Run(rc, records, err.read_text(), LocalStorage(work / "store"))


def _lines(p: Path) -> int:
    try:
        return p.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


@pytest.fixture
def imds() -> Any:
    fake = FakeIMDS()
    yield fake
    fake.close()


def test_aws_notice_checkpoints_the_stopping_step_and_heartbeats(imds: FakeIMDS, tmp_path: Path) -> None:
    deadline: list[float] = []
    run = train_until_notice(
        tmp_path,
        imds,
        "aws",
        lambda: deadline.append(imds.interrupt(in_seconds=120)),
        30,
        "--worker-id",
        "w1",
    )
    assert run.rc == ExitCode.PREEMPTED, run.stderr[-2000:]
    stopping, exit_ = run.last("stopping"), run.last("exit")
    assert stopping["reason"] == "aws spot terminate notice" and stopping["deadline"] == deadline[0]
    assert stopping["save"] is True and "s left" in stopping["save_reason"]
    # 0 lost steps: the emergency checkpoint is at exactly the step training stopped at
    assert stopping["step"] == exit_["durable_step"] == exit_["step"] == run.durable_steps()[-1]
    assert (
        read_latest(run.storage) == stopping["step"]
        and list_checkpoints(run.storage)[stopping["step"]].committed
    )
    assert run.last("notice")["action"] == "spot terminate"
    beat = read_heartbeat(run.storage, "w1")
    assert beat is not None and beat["records"]["exit"] == exit_
    assert (beat["last_step"], beat["durable_step"]) == (stopping["step"],) * 2
    assert {"started", "notice", "stopping", "durable"} <= set(beat["records"])


def test_deadline_too_close_keeps_the_last_durable_checkpoint(imds: FakeIMDS, tmp_path: Path) -> None:
    run = train_until_notice(tmp_path, imds, "aws", lambda: imds.interrupt(in_seconds=1), 30, margin_s=5)
    assert run.rc == ExitCode.PREEMPTED, run.stderr[-2000:]
    stopping, exit_ = run.last("stopping"), run.last("exit")
    assert stopping["save"] is False and "s left, margin 5 s" in stopping["save_reason"], stopping
    durable = exit_["durable_step"]
    assert durable is not None and durable < stopping["step"] and durable == max(run.durable_steps())
    assert stopping["step"] not in list_checkpoints(run.storage) and read_latest(run.storage) == durable
    assert "skipping the emergency checkpoint" in run.stderr


@pytest.mark.parametrize("cloud", ["gcp", "azure"])
def test_gcp_and_azure_notices(cloud: str, tmp_path: Path) -> None:
    fake: FakeGCPMetadata | FakeAzureEvents
    if cloud == "gcp":
        fake = FakeGCPMetadata()
        trigger: Callable[[], object] = fake.preempt
    else:
        fake = FakeAzureEvents()
        trigger = lambda: fake.add_event("Preempt", in_seconds=30)  # noqa: E731
    try:
        run = train_until_notice(tmp_path, fake, cloud, trigger, 5)
    finally:
        fake.close()
    assert run.rc == ExitCode.PREEMPTED, run.stderr[-2000:]
    stopping = run.last("stopping")
    assert stopping["save"] is True and stopping["reason"].startswith(cloud)
    assert stopping["step"] == run.last("exit")["durable_step"] == run.durable_steps()[-1]
