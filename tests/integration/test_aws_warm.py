"""Warm standby instances (`warm: 1`) on moto's EC2 on 127.0.0.1, through the control loop (run_job, no
Prefect server): a standby launched when the attempt starts training, in another zone; a reclaim
without notice handed to it; the unused one terminated at completion and after `warm_idle_s`.

moto starts nothing, so each instance is played by a thread writing the heartbeat its trainer would
(a standby: a heartbeat with no `started` until the controller's lease handoff names a new worker).
The trainers' own side of the handover (`--prewarm-wait` on the lease) is tests/e2e/test_warm_handover.py.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from spotrun.tasks.control.loop import PlainSink, run_job
from spotrun.tasks.control.warm import FROM_POOL, WARM
from spotrun.tasks.decisions.policy import RetryPolicy
from spotrun.tasks.history import HistoryStore
from spotrun.tasks.providers.aws import AwsProvider
from spotrun.tasks.providers.base import ProvisionError
from spotrun.tasks.reports.goodput import RunInfo, compute
from spotrun.tasks.settings import Settings
from spotrun.trainer.checkpoint.completion import mark_completed
from spotrun.trainer.preemption.lease import read_handoff
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import LocalStorage, put_bytes
from spotrun.trainer.telemetry.heartbeat import heartbeat_key
from tests import aws_backdoor
from tests.conftest import Ec2World
from tests.integration.test_aws_provider import instance, make_provider

pytestmark = pytest.mark.timeout(60)
TOTAL = 40


@pytest.fixture
def spec(tmp_path: Path) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": f"warm-{tmp_path.name[-12:]}",  # the moto server outlives the test
            "recipe": "digits",
            "total_steps": TOTAL,
            "storage": str(tmp_path / "store"),
            "preemption": {"notice": "aws"},
            "tracking": {"mlflow": False},
        }
    )


def rec(kind: str, **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "t": time.time(), **fields}


class Played:
    """moto's instances, each played by a thread: the first trains until `ending` says, a standby waits
    for a lease handoff naming a worker it did not know of at its launch, then finishes the job."""

    def __init__(self, world: Ec2World, spec: JobSpec, ending: Callable[[Played, str], bool]) -> None:
        self.world, self.spec, self.ending = world, spec, ending
        self.store = LocalStorage(Path(spec.storage))
        self.launched: list[tuple[str, bool]] = []  # (instance id, standby), in launch order
        self.standby_up = threading.Event()
        self.threads: list[threading.Thread] = []
        self.errors: list[str] = []

    def launch(self, iid: str, script: str) -> None:
        standby = "--prewarm-wait" in script
        self.launched.append((iid, standby))
        t = threading.Thread(target=self._play, args=(iid, standby), daemon=True)
        self.threads.append(t)
        t.start()

    def state(self, iid: str) -> str:
        out = self.world.ec2.describe_instances(InstanceIds=[iid])
        return str(out["Reservations"][0]["Instances"][0]["State"]["Name"])

    def running(self, iid: str) -> bool:
        return self.state(iid) in ("pending", "running")

    def beat(self, iid: str, *records: dict[str, Any]) -> None:
        last = {r["kind"]: r for r in records}
        steps = [r["step"] for r in records if isinstance(r.get("step"), int)]
        body = {"worker_id": iid, "t": time.time(), "pid": 4242, "last_step": max(steps, default=0)}
        body |= {"durable_step": last.get("durable", {}).get("step"), "records": last}
        put_bytes(self.store, heartbeat_key(iid), json.dumps(body).encode())

    def _play(self, iid: str, standby: bool) -> None:
        try:
            (self._stand_by if standby else self._train)(iid)
        except Exception as e:  # reported by the test, not lost in a thread
            self.errors.append(f"{iid}: {e!r}")

    def _train(self, iid: str) -> None:
        started, step = rec("started", step=0, resumed_from=None, total_steps=TOTAL), 0
        while self.running(iid):
            step = min(step + 1, TOTAL - 1)
            self.beat(iid, started, rec("step", step=step, durable_step=None))
            if self.ending(self, iid):
                return
            time.sleep(0.05)

    def _stand_by(self, iid: str) -> None:
        known = set(read_handoff(self.store))
        self.standby_up.set()
        while self.running(iid):
            if set(read_handoff(self.store)) - known - {iid}:  # a holder released: the lease is ours
                self._take_over(iid)
                return
            self.beat(iid)  # building and waiting on the lease: alive, not training
            time.sleep(0.05)

    def _take_over(self, iid: str) -> None:
        """Train as the next attempt's worker until its watch has seen `started` (it arms the next
        standby: a launch after this one), then finish: a completion marker written sooner could count
        for the attempt the controller is still classifying."""
        started = rec("started", step=0, resumed_from=None, total_steps=TOTAL)
        mine = len(self.launched)
        deadline = time.monotonic() + 20
        while len(self.launched) == mine and time.monotonic() < deadline:
            if not self.running(iid):
                return  # a standby released unused (the job completed): its handoff was the last one
            self.beat(iid, started, rec("step", step=1, durable_step=None))
            time.sleep(0.05)
        self.finish(iid)

    def finish(self, iid: str) -> None:
        mark_completed(self.store, self.spec, TOTAL)
        exit_ = rec("exit", code=0, name="COMPLETED", error="", step=TOTAL, durable_step=TOTAL)
        self.beat(iid, rec("started", step=0, resumed_from=None), rec("durable", step=TOTAL), exit_)

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=10)


def warm_provider(world: Ec2World, **over: Any) -> tuple[AwsProvider, Any]:
    """The aws provider with a warm standby; no placement scores (moto does not implement them)."""
    return make_provider(world, prewarm=True, warm=1, placement_scores=False, **over)


def run(world: Ec2World, spec: JobSpec, tmp_path: Path, played: Played, **over: Any) -> AwsProvider:
    provider, _ = warm_provider(world, launcher=played.launch, **over)
    settings = Settings(tmp_path / "home", f"sqlite:///{tmp_path / 'home' / 'history.db'}")
    result = run_job(spec, provider, RetryPolicy(), PlainSink(), settings=settings, sleep=lambda s: None)
    played.join()
    assert not played.errors, played.errors
    assert result.completed, result.message
    return provider


def rows(tmp_path: Path, job: str) -> list[Any]:
    store = HistoryStore.open(f"sqlite:///{tmp_path / 'home' / 'history.db'}")
    try:
        return store.attempts(job=job)
    finally:
        store.close()


@pytest.fixture
def live_runs(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # anything that calls Prefect fails
    yield


def test_a_reclaim_without_notice_hands_the_job_to_the_standby_in_another_zone(
    ec2_world: Ec2World, spec: JobSpec, tmp_path: Path, live_runs: None
) -> None:
    def reclaimed_once_standing_by(played: Played, iid: str) -> bool:
        if not played.standby_up.is_set():
            return False
        aws_backdoor.spot_interrupt(iid, ec2_world.region)  # EC2 takes it back, no notice
        return True

    played = Played(ec2_world, spec, reclaimed_once_standing_by)
    provider = run(ec2_world, spec, tmp_path, played)
    first, second = rows(tmp_path, spec.name)
    assert (first.outcome.value, second.outcome.value) == ("preempted", "completed"), first.cause
    assert first.extra["kill_reason"] == "reclaimed" and first.extra.get("notice_at") is None
    (worker, _), (standby, is_standby), *refill = played.launched
    assert is_standby and second.worker_id == standby  # nothing launched for attempt 2 after the reclaim
    assert second.extra[FROM_POOL]["stood_by_s"] > 0
    placed = {
        i["InstanceId"]: i["Placement"]["AvailabilityZone"]
        for r in ec2_world.ec2.describe_instances(InstanceIds=[worker, standby])["Reservations"]
        for i in r["Instances"]
    }
    assert placed[worker] != placed[standby]  # one zone's reclaim cannot take both
    # attempt 1's standby is priced at the provider's spot price (moto's fixed one), as on the report
    assert provider.prices is not None and provider.prices.spot_per_h == pytest.approx(0.00001)
    assert first.extra[WARM]["standby_s"] > 0 and isinstance(first.extra[WARM]["usd"], float)
    report = compute([first, second], RunInfo(spec.name, "r", "completed", time.time()), time.time())
    assert report.warm_standby_s >= first.extra[WARM]["standby_s"] and report.warm_usd is not None
    # attempt 2 armed a standby of its own (the pool refilled), terminated unused at completion
    assert [s for _, s in refill] == [True] * len(refill)
    assert {played.state(i) for i, _ in played.launched} == {"terminated"}


def test_an_unused_standby_is_terminated_after_warm_idle_s(
    ec2_world: Ec2World, spec: JobSpec, tmp_path: Path, live_runs: None
) -> None:
    idle_s = 0.5

    def done_once_the_standby_is_gone(played: Played, iid: str) -> bool:
        standbys = [i for i, s in played.launched if s]
        if not standbys or played.running(standbys[0]):
            return False
        played.finish(iid)  # the standby's idle limit passed while this one trained: finish
        return True

    played = Played(ec2_world, spec, done_once_the_standby_is_gone)
    run(ec2_world, spec, tmp_path, played, warm_idle_s=idle_s)
    (only,) = rows(tmp_path, spec.name)
    assert only.outcome.value == "completed"
    assert 0 < only.extra[WARM]["standby_s"] <= idle_s and only.extra[WARM]["idle_s"] == idle_s
    assert [s for _, s in played.launched] == [False, True]


def test_a_multi_node_job_is_refused_in_one_line(ec2_world: Ec2World, spec: JobSpec, tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("x")
    provider, _ = warm_provider(ec2_world)
    job = JobSpec.model_validate({**spec.model_dump(), "distributed": {"nnodes": 2, "nproc_per_node": 1}})
    with pytest.raises(ProvisionError, match="set warm: 0, or run the job on one node") as e:
        provider.provision(job, 1, path, [])
    assert not e.value.retryable and "\n" not in str(e.value)
    assert (
        ec2_world.ec2.describe_instances(Filters=[{"Name": "tag:spotrun:job", "Values": [spec.name]}])[
            "Reservations"
        ]
        == []
    )


def test_a_standby_goes_to_another_zone_and_a_single_zone_is_used_with_one_warning(
    ec2_world: Ec2World, spec: JobSpec, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("x")
    provider, _ = warm_provider(ec2_world)
    worker = provider.provision(spec, 1, path, [])
    standby = provider.provision(spec, 2, path, ["--prewarm-wait", "60"])
    try:
        assert standby.handle.placement.az != worker.handle.placement.az
        # the running worker's watch renews the unwatched standby's lease: the sweeper leaves it alone
        ec2_world.ec2.create_tags(Resources=[standby.id], Tags=[{"Key": "spotrun:lease-until", "Value": "0"}])
        provider._renew_standbys(worker.id)
        tags = {t["Key"]: t["Value"] for t in instance(ec2_world, standby.id)["Tags"]}
        assert float(tags["spotrun:lease-until"]) > time.time()
    finally:
        provider.release(standby)
        provider.release(worker)

    one, _ = warm_provider(ec2_world, subnets=ec2_world.subnets[:1])
    caplog.set_level(logging.WARNING, logger="spotrun.tasks.providers.aws.standby")
    workers = [one.provision(spec, 1, path, []) for _ in range(3)]
    try:
        assert len({w.handle.placement.az for w in workers}) == 1
        shared = [r for r in caplog.records if "a reclaim of that zone takes both" in r.getMessage()]
        assert len(shared) == 1  # once per provider
    finally:
        for w in workers:
            one.release(w)
