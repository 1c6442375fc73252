"""The EC2 clients: built here and only here, one per region, and given to the provider (which never
builds one itself)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import boto3
from botocore.config import Config

from spotrun.tasks.providers.aws.config import AwsProviderConfig

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client


def ec2_client(
    region: str, endpoint_url: str | None = None, session: boto3.session.Session | None = None
) -> EC2Client:
    """The one place an EC2 client is built: standard retries, bounded timeouts, and boto3's credential
    chain (or `session`'s)."""
    config = Config(
        retries={"mode": "standard", "total_max_attempts": 5}, connect_timeout=10, read_timeout=60
    )
    client: EC2Client = (session or boto3.session.Session()).client(
        "ec2", region_name=region, endpoint_url=endpoint_url, config=config
    )
    return client


def make_ec2_client(cfg: AwsProviderConfig, session: boto3.session.Session | None = None) -> EC2Client:
    """The provider's client: the config's region and endpoint."""
    return ec2_client(cfg.region, cfg.endpoint_url, session)


def make_ec2_clients(
    cfg: AwsProviderConfig, session: boto3.session.Session | None = None
) -> dict[str, EC2Client]:
    """One client for each of the config's further `regions` (the same endpoint)."""
    return {r.region: ec2_client(r.region, cfg.endpoint_url, session) for r in cfg.regions}
