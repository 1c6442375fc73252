"""An attempt's instances on EC2 after their launch: where one landed, whether they are all gone, and
ending them (on release, or when a launch try fails half way)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from spotrun.tasks.providers.aws.errors import BOTO_ERRORS, error_code
from spotrun.tasks.providers.aws.policy import Placement

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client

log = logging.getLogger(__name__)


def landed(inst: dict[str, Any], pool: Placement) -> Placement:
    """The pool an instance is in, as EC2 reports it (a fleet chooses among pools)."""
    return replace(
        pool,
        subnet=inst.get("SubnetId") or pool.subnet,
        az=(inst.get("Placement") or {}).get("AvailabilityZone") or pool.az,
        instance_type=inst.get("InstanceType") or pool.instance_type,
        market="spot" if inst.get("InstanceLifecycle") == "spot" else pool.market,
    )


def all_terminated(ec2: EC2Client, ids: list[str]) -> bool:
    """True when EC2 lists every one of `ids` as terminated (or knows none of them); an unknown id
    fails the whole call, so then each is asked alone."""
    if not ids:
        return True
    try:
        out = ec2.describe_instances(InstanceIds=ids)
    except BOTO_ERRORS as e:
        if error_code(e) == "InvalidInstanceID.NotFound" and len(ids) == 1:
            return True
        return len(ids) > 1 and all(all_terminated(ec2, [i]) for i in ids)
    found = [i for r in out.get("Reservations", []) for i in r.get("Instances", [])]
    return all(str(i.get("State", {}).get("Name")) == "terminated" for i in found)


def terminate(ec2: EC2Client, ids: list[str]) -> None:
    """TerminateInstances; an unknown id fails the whole call, so then each is ended alone. An instance
    already gone is fine; any other failure raises RuntimeError (an instance left running costs money)."""
    try:
        ec2.terminate_instances(InstanceIds=ids)
    except BOTO_ERRORS as e:
        if error_code(e) == "InvalidInstanceID.NotFound":
            if len(ids) > 1:
                for iid in ids:
                    terminate(ec2, [iid])
            return
        raise RuntimeError(f"could not terminate {', '.join(ids)}: {e}; terminate it by hand") from e


@contextmanager
def terminate_on_error(ec2: EC2Client, ids: list[str]) -> Iterator[None]:
    """Terminate just-launched instances (those in `ids` when it happens: the list may grow in the
    block) if anything (a timeout, a cancellation) escapes the block."""
    try:
        yield
    except BaseException as e:
        try:
            if ids:
                ec2.terminate_instances(InstanceIds=list(ids))
        except BOTO_ERRORS as te:  # the original error propagates; the sweeper catches the leftover
            log.warning("could not terminate %s after %s: %s", ", ".join(ids), type(e).__name__, te)
        raise
