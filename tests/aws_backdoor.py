"""What moto's APIs cannot be asked to do (or not fast enough), done through its in-process backends (the
ThreadedMotoServer shares moto's globals with the tests): a spot reclaim, a pool without capacity, typo
validation, S3 objects by the 10,000.

Touches private moto attributes (`_reason`); checked against moto 5.2.5. Keep every such reach in here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from moto.core import DEFAULT_ACCOUNT_ID
from moto.ec2.exceptions import EC2ClientError
from moto.ec2.models import ec2_backends
from moto.ec2.models.instances import StateReason


def _backend(region: str) -> Any:
    return ec2_backends[DEFAULT_ACCOUNT_ID][region]


def spot_interrupt(instance_id: str, region: str) -> None:
    """EC2 reclaims a spot instance: terminated with StateReason Server.SpotInstanceTermination."""
    inst = _backend(region).get_instance(instance_id)
    inst.terminate()
    inst.state_reason = StateReason(
        "Server.SpotInstanceTermination: Spot instance termination", "Server.SpotInstanceTermination"
    )
    inst._reason = "Service initiated"


@contextmanager
def no_capacity(mp: pytest.MonkeyPatch, region: str, subnets: set[str] | None = None) -> Iterator[None]:
    """RunInstances into `subnets` (every subnet when None) answers InsufficientInstanceCapacity."""
    backend = _backend(region)
    real = backend.run_instances

    def run_instances(*args: Any, **kwargs: Any) -> Any:
        if subnets is None or kwargs.get("subnet_id") in subnets:
            raise EC2ClientError(
                "InsufficientInstanceCapacity",
                f"We currently do not have sufficient {kwargs.get('instance_type')} capacity in the "
                "Availability Zone you requested.",
            )
        return real(*args, **kwargs)

    with mp.context() as m:
        m.setattr(backend, "run_instances", run_instances)
        yield


@contextmanager
def validating(mp: pytest.MonkeyPatch) -> Iterator[None]:
    """moto checks instance types and AMIs (MOTO_EC2_ENABLE_INSTANCE_TYPE_VALIDATION and
    MOTO_ENABLE_AMI_VALIDATION are read once, at import; the flags they set are read per request)."""
    import moto.settings

    with mp.context() as m:
        m.setattr(moto.settings, "EC2_ENABLE_INSTANCE_TYPE_VALIDATION", True)
        m.setattr(moto.settings, "ENABLE_AMI_VALIDATION", True)
        yield


def seed_objects(bucket: str, keys: Iterable[str], body: bytes = b"{}") -> None:
    """Objects written straight into moto's S3 backend: 10,000 in ~0.6 s, where PutObject over HTTP
    takes 3-10 ms each. They list, read and delete over HTTP like any other."""
    from moto.s3.models import s3_backends

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    for key in keys:
        backend.put_object(bucket, key, body)
