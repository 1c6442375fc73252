"""Shared fixtures: an in-process moto S3/EC2 server on 127.0.0.1, fresh buckets, a VPC to launch
workers into, and a fault proxy."""

from __future__ import annotations

import logging
import os
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest

from spotrun.tasks.providers.local import OMP_WAIT
from tests.servers import FaultProxy

# Every trainer the tests start (and their torchrun ranks) inherits this: OpenMP threads that sleep
# while they wait, as the local provider's workers do; spinning ones burn the cores the three xdist
# workers share (tasks/providers/local/provider.py measured the demo at 79 s spinning, 49 s sleeping).
for _k, _v in OMP_WAIT.items():
    os.environ.setdefault(_k, _v)

FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    # Never touch the developer's real profile, and never wait on an instance-metadata timeout. The
    # credentials file is how a local trainer (which never gets the keys above) reaches moto.
    "AWS_CONFIG_FILE": "/nonexistent/spotrun-test-aws-config",
    "AWS_SHARED_CREDENTIALS_FILE": str(Path(__file__).parent / "fakes" / "aws-credentials"),
    "AWS_EC2_METADATA_DISABLED": "true",
}
UNSET_AWS_ENV = (
    "AWS_PROFILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
)


@pytest.fixture(scope="session")
def fake_aws_env() -> Iterator[None]:
    """Fake credentials and region for the whole session, restored afterwards."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in FAKE_AWS_ENV.items():
            mp.setenv(k, v)
        for k in UNSET_AWS_ENV:
            mp.delenv(k, raising=False)
        yield


@pytest.fixture(scope="session")
def httpserver_listen_address() -> tuple[str, int]:
    """pytest-httpserver on 127.0.0.1 and an ephemeral port (its default host is "localhost")."""
    return ("127.0.0.1", 0)


@pytest.fixture(scope="session")
def moto_server(fake_aws_env: None) -> Iterator[str]:
    """A ThreadedMotoServer on 127.0.0.1 (an ephemeral port); yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # verbose=False leaves per-request lines on
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="session")
def boto_session(fake_aws_env: None) -> boto3.session.Session:
    """One boto3 session for test clients: a fresh session per client costs ~0.1 s of model loading."""
    return boto3.session.Session()


@pytest.fixture
def s3_bucket(moto_server: str, boto_session: boto3.session.Session) -> tuple[str, str]:
    """A fresh, uniquely named bucket on the moto server: (endpoint, bucket)."""
    bucket = f"spotrun-test-{uuid.uuid4().hex[:12]}"
    boto_session.client("s3", endpoint_url=moto_server).create_bucket(Bucket=bucket)
    return moto_server, bucket


@pytest.fixture
def fault_proxy(moto_server: str) -> Iterator[FaultProxy]:
    """A proxy in front of moto that can answer the next requests with 503 SlowDown or a reset."""
    proxy = FaultProxy(moto_server).start()
    try:
        yield proxy
    finally:
        proxy.stop()


@dataclass(frozen=True)
class Ec2World:
    """A fresh VPC on the moto server: one subnet per zone, a security group, an AMI, an instance profile."""

    endpoint: str
    region: str
    subnets: list[str]  # in zone order
    azs: dict[str, str]  # subnet -> zone
    security_group: str
    image_id: str
    instance_profile: str
    ec2: Any  # an EC2 client for the test's own look-ups


@pytest.fixture
def ec2_world(moto_server: str, boto_session: boto3.session.Session) -> Ec2World:
    """A VPC in ca-central-1 with subnets in its three zones (a, b, d), ready for `run_instances`."""
    region = "ca-central-1"
    ec2 = boto_session.client("ec2", endpoint_url=moto_server, region_name=region)
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    azs = {}
    for i, zone in enumerate(("a", "b", "d")):
        subnet = ec2.create_subnet(VpcId=vpc, CidrBlock=f"10.0.{i}.0/24", AvailabilityZone=region + zone)
        azs[subnet["Subnet"]["SubnetId"]] = region + zone
    group = ec2.create_security_group(GroupName=f"spotrun-{uuid.uuid4().hex[:8]}", Description="w", VpcId=vpc)
    image = ec2.register_image(Name=f"spotrun-{uuid.uuid4().hex[:8]}", RootDeviceName="/dev/xvda")
    profile = f"spotrun-worker-{uuid.uuid4().hex[:8]}"
    iam = boto_session.client("iam", endpoint_url=moto_server, region_name=region)
    iam.create_instance_profile(InstanceProfileName=profile)
    return Ec2World(
        moto_server,
        region,
        list(azs),
        azs=azs,
        security_group=group["GroupId"],
        image_id=image["ImageId"],
        instance_profile=profile,
        ec2=ec2,
    )


# The longest files first, the rest in collection order after them: with `--dist loadfile
# --no-loadscope-reorder` (the Makefile) xdist hands files to its workers in this order, so the long
# waits (heartbeats, the zombie window, real servers) start early and the short files fill in around
# them; its default order (most tests first) left the one 2-minute host-loss test for last, alone.
# Wall seconds per file on 2 cores, measured in one full run: 120, 125, 90, 105, 100, 95, 75, 75, 60, 60.
LONGEST_FIRST = (
    "tests/e2e/test_host_loss.py",
    "tests/e2e/test_distributed.py",
    "tests/e2e/test_demo.py",
    "tests/e2e/test_flow.py",
    "tests/e2e/test_endings.py",
    "tests/e2e/test_alerts.py",
    "tests/e2e/test_exact_resume.py",
    "tests/e2e/test_chaos.py",
    "tests/integration/test_lease_trainers.py",
    "tests/e2e/test_aws_flow.py",
    "tests/e2e/test_serve.py",
    "tests/integration/test_tracking.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(
        key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank))
    )  # stable: files stay whole


BARE_ROOMS = ("trainer", "tasks", "flows", "deployments")


@pytest.fixture(autouse=True, scope="module")
def no_bare_room_module() -> Iterator[None]:
    """After each test module: no bare `trainer`/`tasks`/`flows`/`deployments` module was ever imported.
    spotrun installs them as `spotrun.trainer`, ...; a bare import from the checkout would load a second
    copy of a module (then `pytest.raises` and monkeypatch miss silently)."""
    yield
    bare = sorted(m for m in sys.modules if m.split(".")[0] in BARE_ROOMS)
    assert not bare, f"bare spotrun modules imported: {bare[:5]}; import them as spotrun.<room>..."
