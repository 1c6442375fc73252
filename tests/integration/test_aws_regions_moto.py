"""Several regions on the aws provider against moto's EC2 on 127.0.0.1 (one server serves every
region): a capacity refusal in every zone of `region` sends the launch to the next region, each region's
instance is launched, watched and released through that region's client, and the job's history orders
the regions (the one hit longest ago first)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest

from spotrun.tasks.providers.aws import AwsProvider
from spotrun.tasks.providers.aws.config import AwsProviderConfig
from spotrun.tasks.providers.aws.policy import PlacementOutcome
from spotrun.tasks.providers.aws.provider import make_ec2_client, make_ec2_clients
from spotrun.trainer.spec.job import JobSpec
from tests import aws_backdoor
from tests.conftest import Ec2World
from tests.integration.test_aws_provider import job, watch

pytestmark = pytest.mark.timeout(60)
__all__ = ["job"]  # the fixture, shared with test_aws_provider.py

OTHER = "us-east-1"


def other_region(world: Ec2World, session: boto3.session.Session) -> dict[str, Any]:
    """A subnet, a security group and an AMI in OTHER, on the same moto server: its `regions` entry."""
    ec2 = session.client("ec2", endpoint_url=world.endpoint, region_name=OTHER)
    vpc = ec2.create_vpc(CidrBlock="10.1.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.1.0.0/24", AvailabilityZone=OTHER + "b")["Subnet"]
    name = f"spotrun-{uuid.uuid4().hex[:8]}"
    group = ec2.create_security_group(GroupName=name, Description="w", VpcId=vpc)["GroupId"]
    image = ec2.register_image(Name=name, RootDeviceName="/dev/sda1")["ImageId"]
    return {"region": OTHER, "subnets": [subnet["SubnetId"]], "image_id": image, "security_groups": [group]}


def two_region_provider(world: Ec2World, session: boto3.session.Session) -> AwsProvider:
    cfg = AwsProviderConfig.model_validate(
        {
            "region": world.region,
            "instance_types": ["g5.xlarge"],
            "subnets": world.subnets[:2],
            "image_id": world.image_id,
            "instance_profile": world.instance_profile,
            "security_groups": [world.security_group],
            "regions": [other_region(world, session)],
            "endpoint_url": world.endpoint,
            "poll_s": 0.02,
            "provision_timeout_s": 5,
            "startup_timeout_s": 5,
            "heartbeat_timeout_s": 5,
        }
    )
    clients = make_ec2_clients(cfg, session)
    return AwsProvider(
        cfg, make_ec2_client(cfg, session), regions_ec2=clients, flow_run_id="flow-1", installation="inst-1"
    )


def test_no_capacity_in_one_region_launches_in_the_next_and_history_orders_them(
    ec2_world: Ec2World,
    job: tuple[JobSpec, Path],
    boto_session: boto3.session.Session,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    provider = two_region_provider(ec2_world, boto_session)
    there = boto_session.client("ec2", endpoint_url=ec2_world.endpoint, region_name=OTHER)
    with aws_backdoor.no_capacity(monkeypatch, ec2_world.region):  # every zone of `region`
        first = provider.provision(job[0], 1, job[1], [])
    assert first.handle.placement.region == OTHER and first.handle.placement.az == OTHER + "b"
    assert [(e.placement.region, e.outcome) for e in provider.history] == [
        (None, PlacementOutcome.CAPACITY),
        (None, PlacementOutcome.CAPACITY),
        (OTHER, PlacementOutcome.LAUNCHED),
    ]
    listed = there.describe_instances(InstanceIds=[first.id])["Reservations"][0]["Instances"][0]
    assert listed["State"]["Name"] == "running" and listed["InstanceLifecycle"] == "spot"

    aws_backdoor.spot_interrupt(first.id, OTHER)  # OTHER is now the region hit last
    result, _ = watch(provider, first)  # watched and released through OTHER's client
    assert result.notice_kind == "spot-interruption"
    second = provider.provision(job[0], 2, job[1], [])
    try:
        assert second.handle.placement.region is None  # `region`: refused longest ago
        assert second.handle.placement.subnet == ec2_world.subnets[0]
    finally:
        provider.release(second)
    assert provider.stop_leftovers("flow-1") == []  # swept in both regions: nothing was left
