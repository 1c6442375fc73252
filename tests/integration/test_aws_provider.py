"""The aws provider against moto's EC2 on 127.0.0.1 (a real HTTP endpoint; no boto3 patching): launch
requests as EC2 stores them, each way a worker ends as tasks/decisions/outcome.py classifies it,
re-provisioning after a reclaim, errors as moto raises them, and the sweeper. The job's storage is a local
directory that the tests (playing the trainer) write heartbeats into."""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import boto3
import pytest

from spotrun.tasks.decisions.attempts import Outcome
from spotrun.tasks.decisions.outcome import classify
from spotrun.tasks.providers.aws import AwsProvider, make_ec2_client
from spotrun.tasks.providers.aws.config import AwsProviderConfig
from spotrun.tasks.providers.aws.errors import NO_CREDENTIALS
from spotrun.tasks.providers.aws.installation import INSTALLATION_FILE, installation_id
from spotrun.tasks.providers.aws.policy import Placement, PlacementEvent, PlacementOutcome
from spotrun.tasks.providers.aws.sweeper import sweep
from spotrun.tasks.providers.aws.watch import SPOT_INTERRUPTION
from spotrun.tasks.providers.base import KillReason, Provider, ProvisionError, WatchResult, Worker
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.spec.job import JobSpec, load_spec
from spotrun.trainer.storage import LocalStorage, put_bytes
from spotrun.trainer.telemetry.heartbeat import heartbeat_key
from spotrun.trainer.telemetry.records import Record
from tests import aws_backdoor
from tests.conftest import Ec2World

pytestmark = pytest.mark.timeout(60)

TYPES = ["g5.xlarge", "g6.xlarge"]


@pytest.fixture
def job(tmp_path: Path) -> tuple[JobSpec, Path]:
    path = tmp_path / "job.yaml"
    path.write_text(f"name: demo\nrecipe: digits\ntotal_steps: 50\nstorage: {tmp_path / 'store'}\n")
    return load_spec(path), path


def make_provider(
    world: Ec2World, session: boto3.session.Session | None = None, **over: Any
) -> tuple[AwsProvider, AwsProviderConfig]:
    seams = {k: over.pop(k) for k in ("launcher", "exit_status", "history", "installation") if k in over}
    cfg = AwsProviderConfig.model_validate(
        {
            "region": world.region,
            "instance_types": TYPES,
            "subnets": world.subnets,
            "image_id": world.image_id,
            "instance_profile": world.instance_profile,
            "security_groups": [world.security_group],
            "kms_key_id": "alias/spotrun-ebs",
            "endpoint_url": world.endpoint,
            "tags": {"team": "ml"},
            "on_demand_price_per_h": {"g5.xlarge": 1.2},
            "poll_s": 0.02,
            "provision_timeout_s": 5,
            "startup_timeout_s": 5,
            "heartbeat_timeout_s": 5,
            **over,
        }
    )
    return AwsProvider(cfg, make_ec2_client(cfg, session), flow_run_id="flow-1", **seams), cfg


def instance(world: Ec2World, iid: str) -> dict[str, Any]:
    found: dict[str, Any] = world.ec2.describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0]
    return found


def beat(job: JobSpec, worker: Worker, *records: dict[str, Any]) -> None:
    """Write the heartbeat the trainer on `worker` would write, holding these records."""
    last = {r["kind"]: r for r in records}
    steps = [r["step"] for r in records if isinstance(r.get("step"), int)]
    body = {
        "worker_id": worker.id,
        "t": time.time(),
        "pid": 4242,
        "last_step": max(steps, default=0),
        "durable_step": last.get("durable", {}).get("step"),
        "records": last,
    }
    put_bytes(LocalStorage(Path(job.storage)), heartbeat_key(worker.id), json.dumps(body).encode())


def rec(kind: str, **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "t": time.time(), **fields}


def watch(provider: AwsProvider, worker: Worker) -> tuple[WatchResult, list[Record]]:
    seen: list[Record] = []
    try:
        return provider.watch(worker, seen.append, None), seen
    finally:
        provider.release(worker)


@pytest.fixture
def released() -> Iterator[list[tuple[AwsProvider, Worker]]]:
    """Workers to release at the end of a test, whatever happened in it."""
    workers: list[tuple[AwsProvider, Worker]] = []
    yield workers
    for provider, worker in workers:
        provider.release(worker)


def test_provider_satisfies_protocol(ec2_world: Ec2World) -> None:
    provider, _ = make_provider(ec2_world)
    assert isinstance(provider, Provider) and provider.name == "aws"


def test_provision_launches_a_tagged_encrypted_spot_instance(
    ec2_world: Ec2World, job: tuple[JobSpec, Path], released: list[tuple[AwsProvider, Worker]]
) -> None:
    provider, _ = make_provider(ec2_world)
    worker = provider.provision(job[0], 1, job[1], ["--max-steps", "20"])
    released.append((provider, worker))
    inst = instance(ec2_world, worker.id)
    assert worker.id == inst["InstanceId"] and worker.provider == "aws" and worker.attempt == 1
    assert inst["State"]["Name"] == "running" and inst["InstanceLifecycle"] == "spot"
    assert inst["SubnetId"] == ec2_world.subnets[0] and inst["InstanceType"] == "g5.xlarge"
    assert inst["MetadataOptions"]["HttpTokens"] == "required"
    assert inst["IamInstanceProfile"]["Arn"].endswith("/" + ec2_world.instance_profile)
    assert [g["GroupId"] for g in inst["SecurityGroups"]] == [ec2_world.security_group]
    tags = {t["Key"]: t["Value"] for t in inst["Tags"]}
    assert tags["spotrun:job"] == "demo" and tags["spotrun:attempt"] == "1" and tags["team"] == "ml"
    assert tags["spotrun:flow-run"] == "flow-1" and tags["Name"] == "spotrun-demo-a1"
    assert tags["spotrun:worker"] == worker.handle.launch_id
    (volume,) = ec2_world.ec2.describe_volumes(
        Filters=[{"Name": "attachment.instance-id", "Values": [worker.id]}]
    )["Volumes"]
    assert (volume["Encrypted"], volume["KmsKeyId"], volume["Size"]) == (True, "alias/spotrun-ebs", 100)
    assert {t["Key"]: t["Value"] for t in volume["Tags"]}["spotrun:job"] == "demo"
    raw = ec2_world.ec2.describe_instance_attribute(InstanceId=worker.id, Attribute="userData")
    script = base64.b64decode(raw["UserData"]["Value"]).decode()
    assert script.startswith("#!/bin/bash\n") and "--max-steps 20" in script
    spec_b64 = script.split("<<'SPOTRUN_JOB_B64'\n")[1].split("\nSPOTRUN_JOB_B64")[0]
    assert base64.b64decode(spec_b64).decode() == job[1].read_text()
    state = worker.handle
    assert (state.placement.az, state.placement.market) == (ec2_world.azs[ec2_world.subnets[0]], "spot")
    assert state.price_per_h == pytest.approx(0.00001)  # moto's fixed spot price
    assert provider.history[-1].outcome is PlacementOutcome.LAUNCHED


def test_release_is_idempotent(ec2_world: Ec2World, job: tuple[JobSpec, Path]) -> None:
    provider, _ = make_provider(ec2_world)
    worker = provider.provision(job[0], 1, job[1], [])
    provider.release(worker)
    provider.release(worker)
    assert instance(ec2_world, worker.id)["State"]["Name"] == "terminated"
    never = replace(worker.handle, instance_id="i-0123456789abcdef0")
    provider.release(
        Worker(never.instance_id, "aws", 1, started_at=0.0, handle=never)
    )  # never existed: fine too


def test_spot_interruption_after_a_notice_is_preempted(
    ec2_world: Ec2World, job: tuple[JobSpec, Path]
) -> None:
    provider, _ = make_provider(ec2_world)
    worker = provider.provision(job[0], 1, job[1], [])
    started = rec("started", step=0, resumed_from=None, total_steps=50)
    progress = [rec("step", step=12, durable_step=10), rec("durable", step=10)]
    stopping = rec("stopping", reason="SIGTERM", step=12)
    beat(job[0], worker, started, *progress, stopping)
    aws_backdoor.spot_interrupt(worker.id, ec2_world.region)
    result, seen = watch(provider, worker)
    assert (result.notice_kind, result.kill_reason) == (SPOT_INTERRUPTION, KillReason.RECLAIMED)
    assert result.kill_detail == "Server.SpotInstanceTermination"
    assert result.notice_at == stopping["t"] and not result.lost
    assert (result.last_step, result.last_durable_step, result.started_training_at) == (12, 10, started["t"])
    assert [r.kind for r in seen] == ["started", "step", "durable", "stopping"]
    assert result.facts["ec2"]["reason_code"] == "Server.SpotInstanceTermination"
    outcome, cause = classify(result, completed=False)
    assert outcome is Outcome.PREEMPTED, cause
    cost = result.facts["cost"]
    assert cost["market"] == "spot" and cost["price_per_h"] == pytest.approx(0.00001)
    assert cost["usd"] is not None and cost["on_demand_usd"] == pytest.approx(1.2 * cost["hours"])
    assert provider.history[-1].outcome is PlacementOutcome.PREEMPTED


def test_spot_interruption_without_a_notice(ec2_world: Ec2World, job: tuple[JobSpec, Path]) -> None:
    provider, _ = make_provider(ec2_world)
    worker = provider.provision(job[0], 1, job[1], [])
    beat(job[0], worker, rec("started", step=0), rec("step", step=5))
    aws_backdoor.spot_interrupt(worker.id, ec2_world.region)
    result, _ = watch(provider, worker)
    assert (result.notice_kind, result.kill_reason, result.kill_detail, result.notice_at) == (
        SPOT_INTERRUPTION,
        KillReason.RECLAIMED,
        "Server.SpotInstanceTermination",
        None,
    )
    assert result.exit_code is None and result.last_step == 5
    assert provider.history[-1].outcome is PlacementOutcome.PREEMPTED


def test_imds_notice_then_preempted_exit(ec2_world: Ec2World, job: tuple[JobSpec, Path]) -> None:
    """The trainer saw the 2-minute notice, checkpointed and exited before EC2 took the instance."""
    provider, _ = make_provider(ec2_world)
    worker = provider.provision(job[0], 1, job[1], [])
    notice = rec("notice", cloud="aws", action="terminate", stop=True, deadline=time.time() + 120)
    stopping = rec("stopping", reason="aws terminate notice", step=30, save=True)
    exit_ = rec("exit", code=75, name="PREEMPTED", error="", step=30, durable_step=30)
    beat(job[0], worker, rec("started", step=0), notice, stopping, rec("durable", step=30), exit_)
    result, _ = watch(provider, worker)
    assert (result.notice_kind, result.notice_at, result.exit_code) == (SPOT_INTERRUPTION, notice["t"], 75)
    outcome, cause = classify(result, completed=False)
    assert outcome is Outcome.PREEMPTED and cause.startswith("spot notice, exited PREEMPTED after")
    assert provider.history[-1].outcome is PlacementOutcome.PREEMPTED


def test_outcome_counts_a_reclaim_without_notice_as_preempted() -> None:
    result = WatchResult(started_at=0.0, ended_at=1.0, notice_kind=SPOT_INTERRUPTION)
    result.kill_reason, result.kill_detail = KillReason.RECLAIMED, "Server.SpotInstanceTermination"
    assert classify(result, completed=False)[0] is Outcome.PREEMPTED


def test_exit_record_ends_the_watch_as_completed(ec2_world: Ec2World, job: tuple[JobSpec, Path]) -> None:
    provider, _ = make_provider(ec2_world)
    worker = provider.provision(job[0], 1, job[1], [])
    records = [
        rec("started", step=0, resumed_from=None),
        rec("step", step=50, durable_step=50),
        rec("durable", step=50),
        rec("exit", code=0, name="COMPLETED", error="", step=50, durable_step=50),
    ]
    beat(job[0], worker, *records)
    result, seen = watch(provider, worker)
    assert (result.exit_code, result.trainer_code, result.last_step, result.last_durable_step) == (
        0,
        "COMPLETED",
        50,
        50,
    )
    assert result.durable_times == [(records[2]["t"], 50)] and result.notice_kind is None
    assert [r.kind for r in seen] == ["started", "step", "durable", "exit"]
    assert result.facts["ec2"]["state"] == "running"  # the trainer is done; release() ends the instance
    assert classify(result, completed=True)[0] is Outcome.COMPLETED
    assert instance(ec2_world, worker.id)["State"]["Name"] == "terminated"
    assert provider.history[-1].outcome is PlacementOutcome.ENDED


def test_stale_heartbeat_is_lost_and_terminated(ec2_world: Ec2World, job: tuple[JobSpec, Path]) -> None:
    provider, _ = make_provider(ec2_world, heartbeat_timeout_s=0.3)
    worker = provider.provision(job[0], 1, job[1], [])
    beat(job[0], worker, rec("started", step=0), rec("step", step=3))
    result = provider.watch(worker, None, None)  # no release: the watch terminates it itself
    assert (
        result.lost
        and result.kill_reason == "lost"
        and result.silent_s is not None
        and result.silent_s >= 0.3
    )
    assert instance(ec2_world, worker.id)["State"]["Name"] in ("shutting-down", "terminated")
    outcome, cause = classify(result, completed=False)
    assert outcome is Outcome.LOST and "no heartbeat for" in cause
    provider.release(worker)


def test_never_starting_is_lost(ec2_world: Ec2World, job: tuple[JobSpec, Path]) -> None:
    provider, _ = make_provider(ec2_world, startup_timeout_s=0.2)
    worker = provider.provision(job[0], 1, job[1], [])
    result, _ = watch(provider, worker)
    outcome, cause = classify(result, completed=False)
    assert outcome is Outcome.LOST and "did not start training" in cause
    assert result.log_tail  # the console output, for a worker that never reported


def test_reprovision_after_preemption_moves_zone_and_type(
    ec2_world: Ec2World, job: tuple[JobSpec, Path]
) -> None:
    provider, _ = make_provider(ec2_world)
    first = provider.provision(job[0], 1, job[1], [])
    aws_backdoor.spot_interrupt(first.id, ec2_world.region)
    watch(provider, first)
    second = provider.provision(job[0], 2, job[1], [])
    try:
        a, b = first.handle.placement, second.handle.placement
        assert a.az != b.az and a.instance_type != b.instance_type
        assert instance(ec2_world, second.id)["SubnetId"] == ec2_world.subnets[1]
    finally:
        provider.release(second)


def test_no_capacity_moves_on_then_gives_a_retryable_error(
    ec2_world: Ec2World, job: tuple[JobSpec, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    provider, _ = make_provider(ec2_world)
    a, b = ec2_world.subnets[:2]
    with aws_backdoor.no_capacity(monkeypatch, ec2_world.region, {a}):
        worker = provider.provision(job[0], 1, job[1], [])
    provider.release(worker)
    assert worker.handle.placement.subnet == b and worker.handle.placement.instance_type == "g5.xlarge"
    assert [(e.placement.subnet, e.outcome, e.error) for e in provider.history] == [
        (a, PlacementOutcome.CAPACITY, "InsufficientInstanceCapacity"),
        (b, PlacementOutcome.LAUNCHED, ""),
    ]
    with aws_backdoor.no_capacity(monkeypatch, ec2_world.region), pytest.raises(ProvisionError) as e:
        provider.provision(job[0], 2, job[1], [])
    assert e.value.retryable and str(e.value).startswith("no spot capacity for g5.xlarge, g6.xlarge in ")


def test_on_demand_after_preemptions(
    ec2_world: Ec2World, job: tuple[JobSpec, Path], released: list[tuple[AwsProvider, Worker]]
) -> None:
    a = ec2_world.subnets[0]
    history = [PlacementEvent(Placement(a, ec2_world.azs[a], "g5.xlarge"), PlacementOutcome.PREEMPTED, 1.0)]
    provider, _ = make_provider(ec2_world, on_demand_after_preemptions=1, history=history)
    worker = provider.provision(job[0], 2, job[1], [])
    released.append((provider, worker))
    assert instance(ec2_world, worker.id).get("InstanceLifecycle") is None  # on-demand
    state = worker.handle
    assert (state.placement.market, state.placement.instance_type, state.price_per_h) == (
        "on-demand",
        "g6.xlarge",
        None,
    )


def test_fleet_launch(
    ec2_world: Ec2World, job: tuple[JobSpec, Path], released: list[tuple[AwsProvider, Worker]]
) -> None:
    provider, _ = make_provider(ec2_world, allocation="fleet")
    worker = provider.provision(job[0], 1, job[1], [])
    released.append((provider, worker))
    inst = instance(ec2_world, worker.id)
    assert inst["InstanceLifecycle"] == "spot" and inst["InstanceType"] in TYPES
    assert {t["Key"]: t["Value"] for t in inst["Tags"]}["spotrun:job"] == "demo"
    assert worker.handle.fleet_id.startswith("fleet-")
    templates = ec2_world.ec2.describe_launch_templates(
        Filters=[{"Name": "tag:spotrun:worker", "Values": [worker.handle.launch_id]}]
    )["LaunchTemplates"]
    assert templates == []  # the per-attempt template is deleted once the instance runs


def test_user_data_runs_the_trainer_with_its_worker_id(
    ec2_world: Ec2World, job: tuple[JobSpec, Path], tmp_path: Path
) -> None:
    """The launcher seam plays the instance: the user data runs locally, with a stand-in for python
    that records its arguments and writes the heartbeat the trainer would."""
    fake = tmp_path / "fake-python"
    fake.write_text(f"""#!{sys.executable}
import json, os, sys, time, yaml
if sys.argv[1:3] == ["-P", "-c"]:  # the user data's version check: this image has our spotrun
    sys.exit(0)
spec = yaml.safe_load(open("job.yaml"))
wid = os.environ["SPOTRUN_WORKER_ID"]
path = os.path.join(spec["storage"], "_workers", wid, "heartbeat.json")
os.makedirs(os.path.dirname(path), exist_ok=True)
now = time.time()
argv = json.dumps(sys.argv[1:])  # in `error`: unknown fields are not kept
exit = {{"kind": "exit", "t": now, "code": 0, "name": "COMPLETED", "step": 7, "error": argv}}
records = {{"started": {{"kind": "started", "t": now, "step": 0}}, "exit": exit}}
beat = {{"worker_id": wid, "t": now, "pid": os.getpid(), "last_step": 7, "records": records}}
json.dump(beat, open(path, "w"))
""")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def launcher(iid: str, script: str) -> None:
        env = {**os.environ, "SPOTRUN_WORKER_ID": iid, "SPOTRUN_TRAINER_USER": ""}  # as this user
        procs[iid] = subprocess.Popen(["bash", "-c", script], env=env)

    def exit_status(iid: str) -> int | None:
        return procs[iid].poll()

    workdir = tmp_path / "instance"
    provider, _ = make_provider(
        ec2_world, python=str(fake), workdir=str(workdir), launcher=launcher, exit_status=exit_status
    )
    worker = provider.provision(job[0], 1, job[1], ["--max-steps", "7"])
    result, _ = watch(provider, worker)
    assert (workdir / "job.yaml").read_text() == job[1].read_text()
    assert result.exit_code == 0 and result.trainer_code == "COMPLETED" and result.last_step == 7
    assert json.loads(result.trainer_error) == [
        "-P",  # the worker's directory cannot shadow spotrun's packages
        "-m",
        "spotrun.trainer",
        "--config",
        "job.yaml",
        "--worker-id",
        worker.id,
        "--max-steps",
        "7",
        "--handover-s",  # prewarm on: train through the notice until the replacement stands by
        "100",
        "--announce-s",  # its poll (the test's) plus a heartbeat's interval
        f"{provider.cfg.poll_s + 5:g}",
    ]


@pytest.mark.parametrize(
    ("over", "says"),
    [
        (
            {"instance_types": ["g99.huge"]},
            "EC2 rejected instance type 'g99.huge' in ca-central-1: check instance_types",
        ),
        (
            {"image_id": "ami-0000000000000dead"},
            "EC2 has no usable AMI 'ami-0000000000000dead' in ca-central-1",
        ),
        ({"subnets": ["subnet-00000000deadbeef0"]}, "check subnets"),
        ({"instance_profile": "no-such-profile"}, "check instance_profile ('no-such-profile' must exist)"),
    ],
)
def test_setup_errors_stop_with_one_line(
    ec2_world: Ec2World,
    job: tuple[JobSpec, Path],
    monkeypatch: pytest.MonkeyPatch,
    over: dict[str, Any],
    says: str,
) -> None:
    provider, _ = make_provider(ec2_world, **over)
    with aws_backdoor.validating(monkeypatch), pytest.raises(ProvisionError) as e:
        provider.provision(job[0], 1, job[1], [])
    assert not e.value.retryable and says in str(e.value) and "\n" not in str(e.value)


def test_no_credentials_is_one_clear_line(
    ec2_world: Ec2World, job: tuple[JobSpec, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/spotrun-test-aws-credentials")
    provider, _ = make_provider(ec2_world, boto3.session.Session())
    with pytest.raises(ProvisionError) as e:
        provider.provision(job[0], 1, job[1], [])
    assert (str(e.value), e.value.retryable) == (NO_CREDENTIALS, False)


ME, OTHER = "0123456789abcdef", "fedcba9876543210"  # two installations' ids, one account


def run_tagged(ec2: Any, tags: dict[str, str]) -> str:
    spec = [{"ResourceType": "instance", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}]
    out = ec2.run_instances(ImageId="ami-12345678", MinCount=1, MaxCount=1, TagSpecifications=spec)
    return str(out["Instances"][0]["InstanceId"])


def states(ec2: Any) -> dict[str, str]:
    return {
        i["InstanceId"]: i["State"]["Name"]
        for r in ec2.describe_instances()["Reservations"]
        for i in r["Instances"]
    }


def test_sweeper_terminates_its_own_workers_of_dead_flow_runs(
    moto_server: str, boto_session: boto3.session.Session
) -> None:
    """Another installation's flow runs are unknown to this one's server: their workers look dead from
    here, and are left alone all the same."""
    ec2 = boto_session.client("ec2", endpoint_url=moto_server, region_name="eu-west-3")  # a region of its own

    def launch(run: str | None, installation: str | None = ME) -> str:
        tags = {"spotrun:job": "j", "spotrun:flow-run": run, "spotrun:installation": installation}
        return run_tagged(ec2, {k: v for k, v in tags.items() if v is not None})

    live = launch("run-live")
    dead = [launch("run-dead") for _ in range(2)]
    unknown = launch("run-unknown")
    untagged = launch(None)  # no flow run: never swept
    unowned = launch("run-dead", installation=None)  # no installation: never swept
    theirs = [launch("run-theirs", OTHER), launch("run-dead", OTHER)]
    asked: list[str] = []

    def is_live(run: str) -> bool:
        asked.append(run)
        return run == "run-live"

    assert sorted(sweep(ec2, is_live, ME)) == sorted([*dead, unknown])
    assert sorted(asked) == ["run-dead", "run-live", "run-unknown"]  # once per flow run, its own only
    now = states(ec2)
    assert {now[i] for i in [live, untagged, unowned, *theirs]} == {"running"}
    assert {now[i] for i in [*dead, unknown]} == {"terminated"}
    assert sweep(ec2, is_live, ME) == []  # idempotent
    assert sweep(ec2, lambda run: run == "run-theirs", OTHER) == [theirs[1]]  # the other one's sweeper
    ec2.terminate_instances(InstanceIds=[live, untagged, unowned, theirs[0]])


def test_two_installations_launch_and_sweep_apart(
    ec2_world: Ec2World, job: tuple[JobSpec, Path], tmp_path: Path
) -> None:
    """Each installation's id is made once under its home; its provider tags with it, its sweeper
    ends its own workers only."""
    ids = [installation_id(tmp_path / "home-a"), installation_id(tmp_path / "home-b")]
    assert ids[0] != ids[1] and installation_id(tmp_path / "home-a") == ids[0]
    assert stat.S_IMODE((tmp_path / "home-a" / INSTALLATION_FILE).stat().st_mode) == 0o600
    providers = [make_provider(ec2_world, installation=i)[0] for i in ids]
    workers = [p.provision(job[0], 1, job[1], []) for p in providers]
    try:
        tags = [{t["Key"]: t["Value"] for t in instance(ec2_world, w.id)["Tags"]} for w in workers]
        assert [t["spotrun:installation"] for t in tags] == ids
        assert sweep(ec2_world.ec2, lambda run: False, ids[0]) == [workers[0].id]
        assert [instance(ec2_world, w.id)["State"]["Name"] for w in workers] == ["terminated", "running"]
        assert providers[1].stop_leftovers("flow-1") == [workers[1].id]  # adoption: its own only
        assert providers[0].stop_leftovers("flow-1") == []
    finally:
        for p, w in zip(providers, workers, strict=True):
            p.release(w)


def test_a_malformed_installation_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / INSTALLATION_FILE).write_text("somebody else's\n")
    with pytest.raises(ConfigError, match="does not hold an installation id"):
        installation_id(tmp_path)


def test_sweeper_terminates_a_live_runs_worker_once_its_lease_ran_out(
    moto_server: str, boto_session: boto3.session.Session
) -> None:
    """A flow process killed outright leaves its run "Running" forever: the lease decides."""
    ec2 = boto_session.client("ec2", endpoint_url=moto_server, region_name="eu-north-1")
    now = time.time()

    def launch(lease: str) -> str:
        return run_tagged(
            ec2,
            {
                "spotrun:job": "l",
                "spotrun:flow-run": "run-zombie",
                "spotrun:installation": ME,
                "spotrun:lease-until": lease,
            },
        )

    fresh, expired, garbled = launch(str(int(now + 600))), launch(str(int(now - 1))), launch("soon")
    assert sorted(sweep(ec2, lambda run: True, ME, now=now)) == sorted([expired, garbled])
    assert sweep(ec2, lambda run: True, ME, now=now + 601) == [fresh]


def test_an_adopting_controller_terminates_the_dead_runs_instances_by_tag(
    moto_server: str, boto_session: boto3.session.Session
) -> None:
    """Host loss on EC2: the new controller runs elsewhere and has no file of the dead one's worker;
    the flow-run tag finds it (and the installation tag keeps another installation's apart)."""
    from spotrun.tasks.providers.aws.sweeper import sweep_flow_run

    ec2 = boto_session.client("ec2", endpoint_url=moto_server, region_name="ap-south-1")

    def launch(run: str, installation: str = ME) -> str:
        return run_tagged(
            ec2, {"spotrun:job": "j", "spotrun:flow-run": run, "spotrun:installation": installation}
        )

    dead, other, theirs = launch("run-dead"), launch("run-other"), launch("run-dead", OTHER)
    assert sweep_flow_run(ec2, "run-dead", ME) == [dead]
    now = states(ec2)
    assert (now[dead], now[other], now[theirs]) == ("terminated", "running", "running")
    assert sweep_flow_run(ec2, "run-dead", ME) == []  # idempotent
    ec2.terminate_instances(InstanceIds=[other, theirs])


# -- multi-node attempts -------------------------------------------------------------------------------


@pytest.fixture
def two_nodes(tmp_path: Path) -> tuple[JobSpec, Path]:
    path = tmp_path / "ddp.yaml"
    path.write_text(
        f"name: demo\nrecipe: digits\ntotal_steps: 50\nstorage: {tmp_path / 'store'}\n"
        "distributed: {nproc_per_node: 1, nnodes: 2, strategy: ddp}\n"
    )
    return load_spec(path), path


def user_data(world: Ec2World, iid: str) -> str:
    raw = world.ec2.describe_instance_attribute(InstanceId=iid, Attribute="userData")
    return base64.b64decode(raw["UserData"]["Value"]).decode()


def test_two_nodes_launch_in_one_pool_and_meet_at_the_first_ones_private_ip(
    ec2_world: Ec2World, two_nodes: tuple[JobSpec, Path], released: list[tuple[AwsProvider, Worker]]
) -> None:
    played: list[str] = []
    provider, _ = make_provider(ec2_world, launcher=lambda iid, script: played.append(iid))
    worker = provider.provision(two_nodes[0], 1, two_nodes[1], ["--lease-takeover", "i-old"])
    released.append((provider, worker))
    state = worker.handle
    assert worker.id == state.instance_id and len(state.instance_ids) == 2 and played == state.instance_ids
    first, second = (instance(ec2_world, iid) for iid in state.instance_ids)
    assert (first["SubnetId"], first["InstanceType"]) == (second["SubnetId"], second["InstanceType"])
    assert state.master_addr == first["PrivateIpAddress"]
    tags = [{t["Key"]: t["Value"] for t in i["Tags"]} for i in (first, second)]
    assert [t["spotrun:node"] for t in tags] == ["0", "1"]
    assert [t["Name"] for t in tags] == ["spotrun-demo-a1-n0", "spotrun-demo-a1-n1"]
    assert {t["spotrun:worker"] for t in tags} == {state.launch_id}  # one launch: swept and scoped alike
    node0, node1 = user_data(ec2_world, first["InstanceId"]), user_data(ec2_world, second["InstanceId"])
    assert "meta-data/local-ipv4" in node0 and "export SPOTRUN_NODE_RANK=0 SPOTRUN_MASTER_ADDR" in node0
    assert f"SPOTRUN_MASTER_ADDR=${{SPOTRUN_MASTER_ADDR:-{first['PrivateIpAddress']}}}" in node1
    assert "export SPOTRUN_NODE_RANK=1 SPOTRUN_MASTER_ADDR" in node1
    assert all("--lease-takeover i-old" in s and "/node" in s for s in (node0, node1))
    assert state.on_demand_price_per_h == pytest.approx(2 * 1.2)  # the attempt's price: both instances
    assert [e.outcome for e in provider.history] == [PlacementOutcome.LAUNCHED] * 2


def test_a_reclaimed_second_node_ends_the_attempt_and_release_ends_both(
    ec2_world: Ec2World, two_nodes: tuple[JobSpec, Path]
) -> None:
    provider, _ = make_provider(ec2_world)
    worker = provider.provision(two_nodes[0], 1, two_nodes[1], [])
    node0, node1 = worker.handle.instance_ids
    beat(two_nodes[0], worker, rec("started", step=0), rec("step", step=8), rec("durable", step=5))
    aws_backdoor.spot_interrupt(node1, ec2_world.region)
    result, _ = watch(provider, worker)
    assert (result.notice_kind, result.kill_reason, result.kill_detail) == (
        SPOT_INTERRUPTION,
        KillReason.RECLAIMED,
        "node 1: Server.SpotInstanceTermination",
    )
    assert (result.last_step, result.last_durable_step, result.exit) == (8, 5, None)
    nodes = result.facts["ec2"]["nodes"]
    assert [(n["instance_id"], n["state"]) for n in nodes] == [(node0, "running"), (node1, "terminated")]
    outcome, cause = classify(result, completed=False)
    assert outcome is Outcome.PREEMPTED and "node 1: Server.SpotInstanceTermination" in cause, cause
    assert provider.history[-1].outcome is PlacementOutcome.PREEMPTED  # the gang's pool is marked
    assert {instance(ec2_world, i)["State"]["Name"] for i in (node0, node1)} == {"terminated"}
    second = provider.provision(two_nodes[0], 2, two_nodes[1], [])
    try:
        assert second.handle.placement.az != worker.handle.placement.az  # the whole gang moves
        assert len({instance(ec2_world, i)["SubnetId"] for i in second.handle.instance_ids}) == 1
        # global rank 0, the storage lease's holder, may have been on node 1: released too
        assert f"--lease-takeover {node1}" in user_data(ec2_world, second.id)
    finally:
        provider.release(second)


def test_node_zero_exit_record_ends_a_two_node_attempt(
    ec2_world: Ec2World, two_nodes: tuple[JobSpec, Path]
) -> None:
    """The other node's own exit record is kept beside the attempt; node 0's decides the outcome."""
    provider, _ = make_provider(ec2_world)
    worker = provider.provision(two_nodes[0], 1, two_nodes[1], [])
    done = rec("exit", code=0, name="COMPLETED", error="", step=50, durable_step=50)
    beat(two_nodes[0], worker, rec("started", step=0), rec("durable", step=50), done)
    peer = Worker(worker.handle.peers[0], "aws", 1, 0.0)
    beat(two_nodes[0], peer, done)
    result, _ = watch(provider, worker)
    assert result.trainer_code == "COMPLETED" and result.kill_reason is None
    assert [n["exit"] for n in result.facts["ec2"]["nodes"]] == ["COMPLETED", "COMPLETED"]
    assert {instance(ec2_world, i)["State"]["Name"] for i in worker.handle.instance_ids} == {"terminated"}


def test_the_node_that_hosts_global_rank_zero_speaks(
    ec2_world: Ec2World, two_nodes: tuple[JobSpec, Path]
) -> None:
    """torchrun may put global rank 0 on node 1; node 0's launcher then writes only its own exit record."""
    provider, _ = make_provider(ec2_world)
    worker = provider.provision(two_nodes[0], 1, two_nodes[1], [])
    peer = Worker(worker.handle.peers[0], "aws", 1, 0.0)
    beat(two_nodes[0], worker)  # node 0's launcher: up, relaying nothing
    records = [rec("started", step=0), rec("step", step=20), rec("durable", step=20)]
    records.append(rec("exit", code=4, name="STOPPED", error="", step=20, durable_step=20))
    beat(two_nodes[0], peer, *records)
    result, seen = watch(provider, worker)
    assert [r.kind for r in seen] == ["started", "step", "durable", "exit"]
    assert (result.trainer_code, result.last_durable_step) == ("STOPPED", 20)
    assert [n["speaks"] for n in result.facts["ec2"]["nodes"]] == [False, True]
