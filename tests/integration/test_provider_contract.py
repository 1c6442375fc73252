"""One contract for every worker provider: the fake, local subprocesses, aws on moto (the test plays the
trainer through its heartbeat) and the aws rehearsal (a local process plays each instance).

Each provider satisfies the Provider protocol; a completed attempt folds started, durable and exit and
ends with exit 0; release is idempotent before, during and after a watch; a reclaim with notice ends with
the trainer's stopping record and notice_at; a hung worker is reported lost; on_status gets typed records
in the order they were written."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from spotrun.tasks.decisions.attempts import Outcome
from spotrun.tasks.decisions.outcome import classify
from spotrun.tasks.providers.aws.config import AwsProviderConfig
from spotrun.tasks.providers.aws.rehearsal import RehearsalProvider
from spotrun.tasks.providers.base import KillReason, Provider, StopCause, WatchResult, Worker
from spotrun.tasks.providers.local import (
    LocalProvider,
    LocalProviderConfig,
    PlannedPreemption,
    SpotSimulatorConfig,
)
from spotrun.trainer.checkpoint.catalog import Catalog
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.spec.job import JobSpec, load_spec
from spotrun.trainer.storage import open_storage
from spotrun.trainer.telemetry.records import Durable, Exit, Notice, Record, Saving, Started, Step, Stopping
from tests import aws_backdoor
from tests.conftest import Ec2World
from tests.fakes.provider import Ending, FakeAttempt, FakeProvider
from tests.integration.test_aws_provider import beat, make_provider
from tests.trainer_runs import write_spec

pytestmark = pytest.mark.timeout(120)

TOTAL = 14  # two checkpoints of the digits job (every 7 steps)
SCENARIOS = ("complete", "notice", "hang")


@dataclass
class Case:
    """One provider set up for one scenario; `before_watch` plays whatever the test must play."""

    provider: Provider
    job: JobSpec
    spec: Path
    extra: list[str] = field(default_factory=list)
    before_watch: Callable[[Worker], None] = lambda w: None
    training: Callable[[Worker], None] = lambda w: None  # returns once the trainer has trained a little
    graceful: bool = True  # stop() waits for the trainer's exit (EC2: the release's shutdown signals it)


def _job(tmp_path: Path, **over: Any) -> tuple[JobSpec, Path]:
    path = write_spec(
        tmp_path / "job.yaml", storage=str(tmp_path / "store"), **{"total_steps": TOTAL, **over}
    )
    return load_spec(path), path


def fake_case(tmp_path: Path, scenario: str, request: pytest.FixtureRequest) -> Case:
    script = {
        "complete": FakeAttempt(),
        "notice": FakeAttempt(until=9, ending=Ending.NOTICE),
        "hang": FakeAttempt(until=3, ending=Ending.LOST),
    }[scenario]
    job, spec = _job(tmp_path)
    return Case(FakeProvider([script], checkpoint_every=7), job, spec)


def local_case(tmp_path: Path, scenario: str, request: pytest.FixtureRequest) -> Case:
    plan = [PlannedPreemption(after_s=0.3)] if scenario == "notice" else []
    cfg = LocalProviderConfig(
        workdir=str(tmp_path / "work"),
        heartbeat_timeout_s=1.0,
        notice_s=30,
        simulator=SpotSimulatorConfig(schedule=plan),
    )
    job, spec = _job(tmp_path, total_steps=TOTAL if scenario == "complete" else 5000)
    extra = ["--inject-fault", "hang@3"] if scenario == "hang" else []
    return Case(LocalProvider(cfg), job, spec, extra, training=lambda w: _first_checkpoint(job))


def _first_checkpoint(job: JobSpec, timeout_s: float = 60) -> None:
    """Unwatched, a local trainer shows it trains by its checkpoints."""
    catalog, deadline = Catalog(open_storage(job.storage)), time.monotonic() + timeout_s
    while catalog.latest() is None:
        assert time.monotonic() < deadline, "no checkpoint from the trainer"
        time.sleep(0.1)


def aws_case(tmp_path: Path, scenario: str, request: pytest.FixtureRequest) -> Case:
    world: Ec2World = request.getfixturevalue("ec2_world")
    provider, _ = make_provider(world, heartbeat_timeout_s=0.5)
    job, spec = _job(tmp_path)
    t = iter(range(1, 100))
    started = Started(t=next(t), step=0, total_steps=TOTAL)
    records: list[Record] = {
        "complete": [
            started,
            Step(t=next(t), step=7),
            Durable(t=next(t), step=7),
            Step(t=next(t), step=14),
            Durable(t=next(t), step=14),
            Exit(t=next(t), code=0, name="COMPLETED", step=14),
        ],
        "notice": [
            started,
            Step(t=next(t), step=7),
            Durable(t=next(t), step=7),
            Notice(t=next(t), cloud="aws", action="terminate", stop=True, deadline=200.0),
            Stopping(t=next(t), reason="aws terminate notice", step=9, save=True),
            Durable(t=next(t), step=9),
            Exit(t=next(t), code=75, name="PREEMPTED", step=9),
        ],
        "hang": [started, Step(t=next(t), step=3)],
    }[scenario]
    base = 1_700_000_000.0  # the heartbeat keeps the last of each kind; order comes from `t`
    typed = [replace(r, t=base + r.t) for r in records]

    def play(worker: Worker) -> None:
        beat(job, worker, *(r.to_json() for r in typed))
        if scenario == "notice":
            aws_backdoor.spot_interrupt(worker.id, world.region)

    return Case(provider, job, spec, before_watch=play, graceful=False)


def rehearsal_case(tmp_path: Path, scenario: str, request: pytest.FixtureRequest) -> Case:
    if scenario != "complete":
        pytest.skip(
            "the rehearsal's notice and heartbeat loss need the stand-in IMDS and minutes of polling: "
            "tests/e2e/test_aws_flow.py covers them through the flow"
        )
    world: Ec2World = request.getfixturevalue("ec2_world")
    endpoint, bucket = request.getfixturevalue("s3_bucket")
    path = write_spec(
        tmp_path / "job.yaml",
        name="contract",
        storage=f"s3://{bucket}/job",
        s3={"endpoint_url": endpoint},
        total_steps=TOTAL,
    )
    cfg = AwsProviderConfig(
        region=world.region,
        instance_types=["g6.xlarge"],
        subnets=world.subnets,
        image_id=world.image_id,
        security_groups=[world.security_group],
        endpoint_url=world.endpoint,
        workdir=str(tmp_path / "i"),
        python=sys.executable,
        poll_s=0.1,
        heartbeat_timeout_s=60,
        rehearse_locally=True,
    )
    return Case(RehearsalProvider(cfg, tmp_path / "instances", None), load_spec(path), path)


PROVIDERS = {"fake": fake_case, "local": local_case, "aws-moto": aws_case, "rehearsal": rehearsal_case}


@pytest.fixture(params=list(PROVIDERS))
def make_case(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[str], Case]:
    return lambda scenario: PROVIDERS[request.param](tmp_path, scenario, request)


def run(
    case: Case, on_record: Callable[[Worker, Record], None] | None = None
) -> tuple[WatchResult, list[Record]]:
    """Provision, watch in this thread, release (twice: idempotent)."""
    worker = case.provider.provision(case.job, 1, case.spec, case.extra)
    seen: list[Record] = []
    me = threading.get_ident()

    def on_status(rec: Record) -> None:
        assert threading.get_ident() == me
        seen.append(rec)
        if on_record is not None:
            on_record(worker, rec)

    try:
        case.before_watch(worker)
        result = case.provider.watch(worker, on_status, None)
    finally:
        case.provider.release(worker)
        case.provider.release(worker)
    assert worker.result is None or worker.result is result
    return result, seen


def assert_typed_in_order(seen: list[Record]) -> None:
    assert seen and all(
        isinstance(r, Started | Step | Saving | Durable | Notice | Stopping | Exit) for r in seen
    ), seen
    assert isinstance(seen[0], Started)
    assert [r.t for r in seen] == sorted(r.t for r in seen)


def test_satisfies_the_protocol(make_case: Callable[[str], Case]) -> None:
    assert isinstance(make_case("complete").provider, Provider)


def test_a_completed_attempt(make_case: Callable[[str], Case]) -> None:
    case = make_case("complete")
    result, seen = run(case)
    assert_typed_in_order(seen)
    assert isinstance(seen[-1], Exit) and seen[-1].code == 0
    assert result.exit_code == 0 and result.trainer_code == "COMPLETED"
    assert result.started is not None and result.start_step == 0 and result.resumed_from is None
    assert (result.last_step, result.last_durable_step) == (TOTAL, TOTAL)
    assert result.durable is not None and result.durable.step == TOTAL
    assert classify(result, completed=True)[0] is Outcome.COMPLETED


def test_release_before_watch(make_case: Callable[[str], Case]) -> None:
    case = make_case("complete")
    worker = case.provider.provision(case.job, 1, case.spec, case.extra)
    case.provider.release(worker)
    case.provider.release(worker)
    result = case.provider.watch(worker, None, None)
    case.provider.release(worker)
    assert result.trainer_code != "COMPLETED" and not result.lost


def test_release_during_watch(make_case: Callable[[str], Case]) -> None:
    case = make_case("hang")  # never ends by itself before the heartbeat timeout

    def release_on_start(worker: Worker, rec: Record) -> None:
        if isinstance(rec, Started):
            case.provider.release(worker)

    result, seen = run(case, release_on_start)
    assert isinstance(seen[0], Started)
    assert result.kill_reason == KillReason.RELEASE and not result.lost
    assert classify(result, completed=False)[0] is Outcome.CRASHED


def test_a_reclaim_with_notice(make_case: Callable[[str], Case]) -> None:
    result, seen = run(make_case("notice"))
    assert_typed_in_order(seen)
    assert result.stopping is not None and result.notice_at is not None
    outcome, cause = classify(result, completed=False)
    assert outcome is Outcome.PREEMPTED and cause.startswith("spot notice"), cause


def test_a_hung_worker_is_lost(make_case: Callable[[str], Case]) -> None:
    result, seen = run(make_case("hang"))
    assert_typed_in_order(seen)
    assert result.lost and result.kill_reason == KillReason.LOST and result.silent_s is not None
    assert classify(result, completed=False)[0] is Outcome.LOST


def test_stop_before_watch(make_case: Callable[[str], Case]) -> None:
    """An interrupt between provisioning and the watch (tasks/control/loop.py): the trainer still stops
    gracefully, with its emergency checkpoint at the step it reached."""
    case = make_case("notice")  # the local trainer's job is long; its simulated notice needs a watch
    worker = case.provider.provision(case.job, 1, case.spec, case.extra)
    try:
        case.training(worker)
        result = case.provider.stop(worker, StopCause.INTERRUPT)
    finally:
        case.provider.release(worker)
    assert worker.result is result and result.stopped_by is StopCause.INTERRUPT
    assert result.ended_at is not None
    if case.graceful:
        assert result.stopping is not None and result.exit_code == ExitCode.PREEMPTED
        assert result.last_durable_step == result.stopping.step == result.last_step
