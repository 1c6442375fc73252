"""Terminate workers whose flow run is gone: the backstop for a flow process that died (SIGKILL, a lost
machine) between launching an instance and releasing it.

Only this installation's instances are considered: those tagged `spotrun:flow-run` and with its id in
`spotrun:installation` (installation.py). Another spotrun installation in the same account has its
own server, which knows nothing of this one's flow runs: their instances would all look dead here.
`is_live(flow_run_id)` is given (the caller asks
Prefect), so this module knows nothing of Prefect. A flow process killed outright leaves its run
"Running" in Prefect for good, so liveness alone is not enough: the watching flow renews each
instance's `spotrun:lease-until` tag, and an instance whose lease ran out is swept whatever its run's
state says. Safe to run any time and often: terminating an instance twice is a no-op, and a worker
whose flow still watches it is never touched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from spotrun.tasks.providers.aws.launch import TAG_FLOW_RUN, TAG_INSTALLATION, TAG_LEASE

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client

log = logging.getLogger(__name__)

SWEPT_STATES = ["pending", "running", "stopping", "stopped"]
TERMINATE_BATCH = 1000  # ids per TerminateInstances call


def lease_expired(tags: dict[str, str], now: float) -> bool:
    """True when the instance carries a lease tag whose time has passed (a malformed one counts)."""
    value = tags.get(TAG_LEASE)
    if value is None:
        return False
    try:
        return float(value) < now
    except ValueError:
        return True


def orphans(
    ec2: EC2Client, is_live: Callable[[str], bool], installation: str, now: float | None = None
) -> list[tuple[str, str]]:
    """(instance id, flow run id) of every instance of this installation whose flow run is not live, or
    whose lease ran out."""
    now = time.time() if now is None else now
    pages = ec2.get_paginator("describe_instances").paginate(
        Filters=[
            {"Name": "tag-key", "Values": [TAG_FLOW_RUN]},
            {"Name": f"tag:{TAG_INSTALLATION}", "Values": [installation]},
            {"Name": "instance-state-name", "Values": SWEPT_STATES},
        ]
    )
    runs: dict[str, bool] = {}  # ask once per flow run
    found = []
    for page in pages:
        for res in page.get("Reservations", []):
            for inst in res.get("Instances", []):
                tags = {t["Key"]: t["Value"] for t in inst.get("Tags", []) if "Key" in t and "Value" in t}
                run = tags.get(TAG_FLOW_RUN, "")
                if run not in runs:
                    runs[run] = bool(run) and is_live(run)
                if not runs[run] or lease_expired(tags, now):
                    found.append((inst["InstanceId"], run))
    return found


def sweep(
    ec2: EC2Client, is_live: Callable[[str], bool], installation: str, now: float | None = None
) -> list[str]:
    """Terminate this installation's instances of flow runs that are finished, cancelled, crashed or
    unknown, and those whose lease ran out; return their ids."""
    doomed = orphans(ec2, is_live, installation, now)
    ids = [iid for iid, _ in doomed]
    for iid, run in doomed:
        log.warning("sweeping %s: its flow run %s is not live or its lease ran out", iid, run or "(none)")
    for i in range(0, len(ids), TERMINATE_BATCH):
        ec2.terminate_instances(InstanceIds=ids[i : i + TERMINATE_BATCH])
    return ids


def sweep_flow_run(ec2: EC2Client, flow_run_id: str, installation: str) -> list[str]:
    """Terminate every instance a (dead) flow run of this installation launched: a new controller
    adopting its job calls this before it starts a worker, whatever host the dead one ran on (the tags
    are the only trace)."""
    pages = ec2.get_paginator("describe_instances").paginate(
        Filters=[
            {"Name": f"tag:{TAG_FLOW_RUN}", "Values": [flow_run_id]},
            {"Name": f"tag:{TAG_INSTALLATION}", "Values": [installation]},
            {"Name": "instance-state-name", "Values": SWEPT_STATES},
        ]
    )
    ids = [
        i["InstanceId"]
        for page in pages
        for r in page.get("Reservations", [])
        for i in r.get("Instances", [])
    ]
    for i in range(0, len(ids), TERMINATE_BATCH):
        ec2.terminate_instances(InstanceIds=ids[i : i + TERMINATE_BATCH])
    for iid in ids:
        log.warning("terminated %s, left running by flow run %s whose controller died", iid, flow_run_id)
    return ids
