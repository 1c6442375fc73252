"""The resilient-training flow with the `aws` provider against moto's EC2 and S3 on 127.0.0.1.

Launching creates the moto instance; a local process plays it (the instance's own user data, in
rehearsal mode), follows the stand-in IMDS for spot notices and heartbeats through the job's S3
storage. moto never interrupts anything itself: the test schedules the notice and then reclaims the
instance through moto's backend, as EC2 would two minutes later.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from spotrun.tasks.control.sweeping import flow_run_is_live
from spotrun.tasks.providers.aws.config import AwsProviderConfig
from spotrun.tasks.providers.aws.installation import installation_id
from spotrun.tasks.providers.aws.sweeper import sweep
from spotrun.trainer.checkpoint.catalog import fetch, read_latest
from spotrun.trainer.checkpoint.format import COMPLETED, MANIFEST, Manifest, step_dir
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import Storage, get_bytes, open_storage
from spotrun.trainer.telemetry.heartbeat import read_heartbeat
from tests.aws_backdoor import spot_interrupt
from tests.conftest import Ec2World
from tests.e2e.test_flow import attempts, job, reference_dir, run_flow
from tests.fakes.imds import FakeIMDS
from tests.procs import wait_gone
from tests.trainer_runs import assert_states_equal

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def imds(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeIMDS]:
    fake = FakeIMDS()
    monkeypatch.setenv("SPOTRUN_IMDS_ENDPOINT", fake.endpoint)  # the played instances inherit it
    yield fake
    fake.close()


def ec2_job(tmp_path: Path, s3_bucket: tuple[str, str], **overrides: Any) -> JobSpec:
    endpoint, bucket = s3_bucket
    return job(
        tmp_path,
        name=f"ec2-{uuid.uuid4().hex[:6]}",
        storage=f"s3://{bucket}/job",
        s3={"endpoint_url": endpoint},
        preemption={"notice": "aws", "poll_s": 0.2},
        **overrides,
    )


def provider(world: Ec2World, tmp_path: Path) -> AwsProviderConfig:
    return AwsProviderConfig(
        region=world.region,
        instance_types=["g6.xlarge", "g5.xlarge"],
        subnets=world.subnets,
        image_id=world.image_id,
        security_groups=[world.security_group],
        endpoint_url=world.endpoint,
        python=sys.executable,
        workdir=str(tmp_path / "instance"),
        poll_s=0.2,
        heartbeat_timeout_s=60,
        rehearse_locally=True,
        on_demand_price_per_h={"g6.xlarge": 0.8, "g5.xlarge": 1.0},
    )


def instances(world: Ec2World, job_name: str) -> list[dict[str, Any]]:
    out = world.ec2.describe_instances(Filters=[{"Name": "tag:spotrun:job", "Values": [job_name]}])
    found = [i for r in out["Reservations"] for i in r["Instances"]]
    return sorted(found, key=lambda i: i["LaunchTime"])


def ids(world: Ec2World, job_name: str) -> list[str]:
    return [i["InstanceId"] for i in instances(world, job_name)]


def wait_for(what: str, check: Any, timeout_s: float = 120) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def reclaim_first(
    world: Ec2World, spec: JobSpec, store: Storage, imds: FakeIMDS, *, errors: list[str]
) -> None:
    """Notice once the first instance trains, then take the instance once its trainer has left."""
    try:
        iid = wait_for("the first instance", lambda: [i["InstanceId"] for i in instances(world, spec.name)])[
            0
        ]
        wait_for("training on it", lambda: (read_heartbeat(store, iid) or {}).get("durable_step"))
        imds.interrupt(in_seconds=120)
        # Once its trainer has the notice, take it back: the next instance has its own metadata service,
        # and this one is shared. The controller provisions that instance only when the heartbeat shows
        # the notice, and the old trainer trains on until it stands by (trainer/preemption/handover.py).
        wait_for("the notice seen", lambda: "notice" in (read_heartbeat(store, iid) or {}).get("records", {}))
        imds.clear_notice()
        wait_for("its exit record", lambda: "exit" in (read_heartbeat(store, iid) or {}).get("records", {}))
        spot_interrupt(iid, world.region)
    except Exception as e:  # reported by the test, not lost in a thread
        errors.append(repr(e))


def test_notice_checkpoints_then_another_zone_resumes_bitwise(
    prefect_api: str,
    home: Path,
    tmp_path: Path,
    ec2_world: Ec2World,
    s3_bucket: tuple[str, str],
    imds: FakeIMDS,
) -> None:
    spec = ec2_job(tmp_path, s3_bucket, total_steps=1200)
    store = open_storage(spec.storage, spec.s3)
    errors: list[str] = []
    reclaimer = threading.Thread(
        target=reclaim_first, args=(ec2_world, spec, store, imds), kwargs={"errors": errors}
    )
    reclaimer.start()
    state = run_flow(spec, provider(ec2_world, tmp_path))  # type: ignore[arg-type]
    reclaimer.join(timeout=30)
    assert not errors, errors
    assert state.is_completed(), state.message
    rows = attempts(home)
    assert [r.outcome.value for r in rows] == ["preempted", "completed"], [r.cause for r in rows]
    assert rows[0].lost_steps == 0 and rows[1].resumed_from == rows[0].last_step  # the notice lost nothing
    assert rows[0].extra["cost"]["market"] == "spot" and rows[0].extra["cost"]["on_demand_usd"] > 0
    first, second = instances(ec2_world, spec.name)
    assert first["Placement"]["AvailabilityZone"] != second["Placement"]["AvailabilityZone"]
    assert {i["State"]["Name"] for i in (first, second)} == {"terminated"}  # nothing left running
    final = fetch(store, spec.total_steps, tmp_path / "fetched")
    assert_states_equal(final, reference_dir(spec, tmp_path))


FLOW_SCRIPT = """
import sys
from spotrun.flows.resilient_training import resilient_training
from spotrun.tasks.providers.aws.config import AwsProviderConfig
from spotrun.trainer.spec.job import JobSpec
spec, cfg = JobSpec.model_validate_json(sys.argv[1]), AwsProviderConfig.model_validate_json(sys.argv[2])
resilient_training(spec, cfg)
"""


def test_sweeper_terminates_the_worker_of_a_killed_flow_process(
    prefect_api: str,
    home: Path,
    tmp_path: Path,
    ec2_world: Ec2World,
    s3_bucket: tuple[str, str],
    imds: FakeIMDS,
) -> None:
    spec = ec2_job(tmp_path, s3_bucket, total_steps=100_000)
    cfg = provider(ec2_world, tmp_path)
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-c", FLOW_SCRIPT, spec.model_dump_json(), cfg.model_dump_json()]
    flow_proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        store = open_storage(spec.storage, spec.s3)
        iid = wait_for(
            "a running instance", lambda: [i["InstanceId"] for i in instances(ec2_world, spec.name)]
        )[0]
        wait_for("training on it", lambda: (read_heartbeat(store, iid) or {}).get("durable_step"))
        os.kill(flow_proc.pid, signal.SIGKILL)  # no finally, no release: the instance stays up
        flow_proc.wait()
        pid = (read_heartbeat(store, iid) or {}).get("pid")
        assert pid and wait_gone(int(pid), 20), "the process playing the instance outlived the flow"
    finally:
        if flow_proc.poll() is None:
            flow_proc.kill()
    (inst,) = instances(ec2_world, spec.name)
    assert inst["State"]["Name"] == "running"
    run_id = {t["Key"]: t["Value"] for t in inst["Tags"]}["spotrun:flow-run"]
    assert flow_run_is_live(run_id)  # Prefect still says Running: a killed process reports nothing
    installation = installation_id(home)  # the flow's, kept under its SPOTRUN_HOME
    assert sweep(ec2_world.ec2, flow_run_is_live, installation) == []  # the lease still runs: it waits
    later = time.time() + cfg.lease_s + 1  # once the lease is past, nobody renewed it
    assert sweep(ec2_world.ec2, flow_run_is_live, installation, now=later) == [iid]
    assert [i["State"]["Name"] for i in instances(ec2_world, spec.name)] == ["terminated"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tag(inst: dict[str, Any], key: str) -> str:
    return {t["Key"]: t["Value"] for t in inst.get("Tags", [])}.get(key, "")


def by_node(found: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(found, key=lambda i: tag(i, "spotrun:node"))


def reclaim_second_node(world: Ec2World, spec: JobSpec, store: Storage, errors: list[str]) -> None:
    """Once the two nodes have rendezvoused and a checkpoint is durable, EC2 takes node 1 (no notice)."""
    try:
        listed = wait_for(
            "two nodes", lambda: len(ids(world, spec.name)) == 2 and instances(world, spec.name)
        )
        node0, node1 = by_node(listed)
        wait_for(
            "a durable checkpoint",
            lambda: any(  # on the node that hosts global rank 0
                (read_heartbeat(store, i["InstanceId"]) or {}).get("durable_step") for i in (node0, node1)
            ),
        )
        spot_interrupt(node1["InstanceId"], world.region)
    except Exception as e:  # reported by the test, not lost in a thread
        errors.append(repr(e))


def test_two_nodes_one_reclaimed_both_released_then_resumed_on_two_new_ones(
    prefect_api: str,
    home: Path,
    tmp_path: Path,
    ec2_world: Ec2World,
    s3_bucket: tuple[str, str],
    imds: FakeIMDS,
) -> None:
    ddp = {"nproc_per_node": 1, "nnodes": 2, "strategy": "ddp", "port": free_port()}
    spec = ec2_job(
        tmp_path,
        s3_bucket,
        total_steps=160,
        batch_size=32,
        distributed=ddp,
        checkpoint={"every_steps": 10, "keep": 2},
    )
    store = open_storage(spec.storage, spec.s3)
    errors: list[str] = []
    reclaimer = threading.Thread(target=reclaim_second_node, args=(ec2_world, spec, store, errors))
    reclaimer.start()
    state = run_flow(spec, provider(ec2_world, tmp_path))  # type: ignore[arg-type]
    reclaimer.join(timeout=30)
    assert not errors, errors
    assert state.is_completed(), state.message
    rows = attempts(home)
    assert [r.outcome.value for r in rows] == ["preempted", "completed"], [r.cause for r in rows]
    assert "node 1: Server.SpotInstanceTermination" in rows[0].cause, rows[0].cause
    # the row's durable step is the last the watch saw; a later one may have landed before the kill
    assert rows[0].last_durable_step and (rows[1].resumed_from or 0) >= rows[0].last_durable_step
    first, second = (
        by_node(i for i in instances(ec2_world, spec.name) if tag(i, "spotrun:attempt") == a)
        for a in ("1", "2")
    )
    assert [tag(i, "spotrun:node") for i in first + second] == ["0", "1", "0", "1"]
    assert [r.worker_id for r in rows] == [
        first[0]["InstanceId"],
        second[0]["InstanceId"],
    ]  # the worker: node 0
    assert {p.name for p in (tmp_path / "instance").iterdir()} == {"node0", "node1"}  # a cache each
    assert {i["State"]["Name"] for i in first + second} == {"terminated"}  # both released, twice
    zones = [{i["Placement"]["AvailabilityZone"] for i in nodes} for nodes in (first, second)]
    assert len(zones[0]) == len(zones[1]) == 1 and zones[0] != zones[1]  # the gang moved together
    final = Manifest.from_json(get_bytes(store, f"{step_dir(spec.total_steps)}/{MANIFEST}"))
    assert final.world_size == 2 and read_latest(store) == spec.total_steps
    assert get_bytes(store, COMPLETED)
