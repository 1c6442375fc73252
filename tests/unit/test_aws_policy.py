"""Table tests of the aws provider's pure parts: where the next attempt runs, what each EC2 error means,
the config's edge checks, the launch requests and the cost of an attempt."""

from __future__ import annotations

import base64
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError
from pydantic import ValidationError

from spotrun.tasks.providers.aws import launch
from spotrun.tasks.providers.aws.config import AwsProviderConfig
from spotrun.tasks.providers.aws.cost import Cost, attempt_cost
from spotrun.tasks.providers.aws.errors import NO_CREDENTIALS, ErrorKind, LaunchContext, classify_error
from spotrun.tasks.providers.aws.policy import (
    Placement,
    PlacementEvent,
    PlacementOutcome,
    choose_market,
    next_placement,
    rank_placements,
    spot_shortage_since,
)
from spotrun.tasks.providers.aws.watch import SPOT_INTERRUPTION, AwsWorkerState, end_of_instance, gang_end
from spotrun.tasks.providers.base import KillReason
from spotrun.trainer.interpreter import spotrun_version
from spotrun.trainer.storage import LocalStorage

A, B, C = "subnet-0000000a", "subnet-0000000b", "subnet-0000000c"
AZS = {A: "ca-central-1a", B: "ca-central-1b", C: "ca-central-1d"}
P, CAP, OK = PlacementOutcome.PREEMPTED, PlacementOutcome.CAPACITY, PlacementOutcome.LAUNCHED


def cfg(**over: Any) -> AwsProviderConfig:
    base: dict[str, Any] = {
        "region": "ca-central-1",
        "instance_types": ["g5.xlarge", "g6.xlarge"],
        "subnets": [A, B, C],
        "image_id": "ami-0123456789abcdef0",
    }
    return AwsProviderConfig.model_validate({**base, **over})


def ev(
    subnet: str | None, itype: str, outcome: PlacementOutcome, t: float, *, market: str = "spot"
) -> PlacementEvent:
    az = AZS.get(subnet or "")
    return PlacementEvent(Placement(subnet, az, itype, market), outcome, t)  # type: ignore[arg-type]


# -- where the next attempt runs ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("history", "expected"),
    [
        ([], (A, "g5.xlarge")),
        # a launch that went fine changes nothing
        ([ev(A, "g5.xlarge", OK, 1)], (A, "g5.xlarge")),
        # preempted in a/g5: another zone and another type
        ([ev(A, "g5.xlarge", P, 1)], (B, "g6.xlarge")),
        # then b/g6 too: the zone never hit, with the type hit longest ago
        ([ev(A, "g5.xlarge", P, 1), ev(B, "g6.xlarge", P, 2)], (C, "g5.xlarge")),
        # every zone hit: the zone hit longest ago, with the other type
        ([ev(A, "g5.xlarge", P, 1), ev(B, "g6.xlarge", P, 2), ev(C, "g5.xlarge", CAP, 3)], (A, "g6.xlarge")),
        # least recently preempted first, whatever the order of the list: g6 was hit longer ago
        ([ev(B, "g6.xlarge", P, 5), ev(A, "g5.xlarge", P, 9)], (C, "g6.xlarge")),
        # no capacity counts like a preemption
        ([ev(A, "g5.xlarge", CAP, 1)], (B, "g6.xlarge")),
        # a failure that is not about capacity does not steer
        ([PlacementEvent(Placement(A, AZS[A], "g5.xlarge"), PlacementOutcome.FAILED, 1)], (A, "g5.xlarge")),
    ],
)
def test_next_placement(history: list[PlacementEvent], expected: tuple[str, str]) -> None:
    p = next_placement(cfg(), history, AZS, now=10)
    assert (p.subnet, p.instance_type) == expected
    assert p.az == AZS[expected[0]]


def test_without_subnets_the_policy_rotates_types() -> None:
    c = cfg(subnets=[])
    assert next_placement(c, [], {}, 0) == Placement(None, None, "g5.xlarge")
    assert next_placement(c, [ev(None, "g5.xlarge", P, 1)], {}, 2).instance_type == "g6.xlarge"


def test_ranking_lists_every_pool_once() -> None:
    pools = rank_placements(cfg(), [ev(A, "g5.xlarge", P, 1)], AZS, "spot")
    assert len(pools) == 6 and len(set(pools)) == 6
    assert pools[-1] == Placement(A, AZS[A], "g5.xlarge")  # the pool that was just preempted: last


@pytest.mark.parametrize(
    ("over", "history", "now", "market"),
    [
        ({}, [ev(A, "g5.xlarge", P, 1)] * 5, 100, "spot"),
        ({"on_demand_after_preemptions": 2}, [ev(A, "g5.xlarge", P, 1)], 100, "spot"),
        (
            {"on_demand_after_preemptions": 2},
            [ev(A, "g5.xlarge", P, 1), ev(B, "g6.xlarge", P, 2)],
            100,
            "on-demand",
        ),
        # 60 s of spot capacity failures
        ({"on_demand_after_s": 60}, [ev(A, "g5.xlarge", CAP, 10), ev(B, "g5.xlarge", CAP, 40)], 69, "spot"),
        (
            {"on_demand_after_s": 60},
            [ev(A, "g5.xlarge", CAP, 10), ev(B, "g5.xlarge", CAP, 40)],
            70,
            "on-demand",
        ),
        # a spot launch in between ends the streak
        ({"on_demand_after_s": 60}, [ev(A, "g5.xlarge", CAP, 10), ev(B, "g5.xlarge", OK, 20)], 100, "spot"),
        (
            {"on_demand_after_s": 60},
            [ev(A, "g5.xlarge", CAP, 10), ev(B, "g5.xlarge", OK, 20), ev(B, "g5.xlarge", CAP, 30)],
            100,
            "on-demand",
        ),
        # sticky: an on-demand launch does not end the spot streak
        (
            {"on_demand_after_s": 60},
            [ev(A, "g5.xlarge", CAP, 10), ev(A, "g5.xlarge", OK, 80, market="on-demand")],
            200,
            "on-demand",
        ),
    ],
)
def test_choose_market(over: dict[str, Any], history: list[PlacementEvent], now: float, market: str) -> None:
    assert choose_market(cfg(**over), history, now) == market


def test_shortage_starts_at_first_failure() -> None:
    assert spot_shortage_since([]) is None
    assert spot_shortage_since([ev(A, "g5.xlarge", CAP, 7), ev(B, "g5.xlarge", CAP, 9)]) == 7


# -- what each EC2 error means -----------------------------------------------------------------------

CTX = LaunchContext(
    "ca-central-1", "g99.huge", "ami-0123456789abcdef0", subnet=A, instance_profile="spotrun-worker"
)


def client_error(code: str, message: str = "", status: int = 400) -> ClientError:
    response: Any = {
        "Error": {"Code": code, "Message": message},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(response, "RunInstances")


@pytest.mark.parametrize(
    ("code", "message", "kind", "says"),
    [
        (
            "InsufficientInstanceCapacity",
            "We currently do not have sufficient g5 capacity",
            ErrorKind.CAPACITY,
            "no capacity for g99.huge in subnet-0000000a",
        ),
        ("SpotMaxPriceTooLow", "", ErrorKind.CAPACITY, "trying other zones"),
        ("MaxSpotInstanceCountExceeded", "", ErrorKind.CAPACITY, "no capacity"),
        ("InsufficientCapacity", "no spot capacity", ErrorKind.CAPACITY, "no capacity"),
        (
            "Unsupported",
            "Your requested instance type is not supported in your requested Availability Zone",
            ErrorKind.CAPACITY,
            "no capacity",
        ),
        ("RequestLimitExceeded", "Request limit exceeded.", ErrorKind.TRANSIENT, "throttling"),
        ("InstanceLimitExceeded", "", ErrorKind.QUOTA, "Service Quotas"),
        ("VcpuLimitExceeded", "", ErrorKind.QUOTA, "quota reached in ca-central-1 for g99.huge"),
        ("InvalidAMIID.NotFound", "", ErrorKind.IMAGE, "check image_id"),
        ("InvalidAMIID.Malformed", "", ErrorKind.IMAGE, "'ami-0123456789abcdef0'"),
        (
            "InvalidInstanceType",
            "",
            ErrorKind.INSTANCE_TYPE,
            "EC2 rejected instance type 'g99.huge' in ca-central-1: check instance_types",
        ),
        (
            "InvalidParameterValue",
            "Invalid value 'g99.huge' for InstanceType.",
            ErrorKind.INSTANCE_TYPE,
            "check instance_types",
        ),
        ("AuthFailure", "", ErrorKind.AUTH, "check the credentials"),
        ("UnauthorizedOperation", "You are not authorized", ErrorKind.AUTH, "docs/aws.md"),
        ("InvalidClientTokenId", "", ErrorKind.AUTH, "AWS refused"),
        (
            "InvalidSubnetID.NotFound",
            "The subnet ID 'subnet-0000000a' does not exist",
            ErrorKind.CONFIG,
            "check subnets",
        ),
        ("InvalidGroup.NotFound", "", ErrorKind.CONFIG, "check security_groups"),
        (
            "InvalidParameterValue",
            "Value (x) for parameter iamInstanceProfile.name is invalid",
            ErrorKind.CONFIG,
            "check instance_profile",
        ),
        ("NoSuchEntity", "Instance profile x not found", ErrorKind.CONFIG, "check instance_profile"),
        ("SomethingNew", "", ErrorKind.UNKNOWN, "EC2 call failed"),
    ],
)
def test_error_mapping(code: str, message: str, kind: ErrorKind, says: str) -> None:
    found = classify_error(client_error(code, message), CTX)
    assert found.kind is kind
    assert says in found.message
    assert "\n" not in found.message
    err = found.error()
    assert err.retryable is (kind in (ErrorKind.CAPACITY, ErrorKind.TRANSIENT))


def test_unknown_server_errors_are_transient() -> None:
    assert classify_error(client_error("Weird", "", status=503), CTX).kind is ErrorKind.TRANSIENT


@pytest.mark.parametrize(
    ("exc", "kind", "message"),
    [
        (NoCredentialsError(), ErrorKind.AUTH, NO_CREDENTIALS),
        (
            EndpointConnectionError(endpoint_url="https://ec2.ca-central-1.amazonaws.com"),
            ErrorKind.TRANSIENT,
            "cannot reach EC2 in ca-central-1",
        ),
    ],
)
def test_botocore_errors(exc: Exception, kind: ErrorKind, message: str) -> None:
    found = classify_error(exc, CTX)
    assert found.kind is kind and message in found.message


def test_no_credentials_says_how_to_fix() -> None:
    assert NO_CREDENTIALS == (
        "no AWS credentials: set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
        "or run on an instance with a role"
    )


# -- the config's edge checks ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("over", "says"),
    [
        ({"image_id": None}, "set image_id (an AMI) or launch_template"),
        ({"launch_template": {"name": "spotrun"}}, "not both"),
        ({"image_id": None, "launch_template": {}}, "exactly one of launch_template.name"),
        ({"region": "ca-central-1a"}, "not a region name"),
        ({"instance_types": []}, "at least 1"),
        ({"instance_types": ["g5.xlarge", "g5.xlarge"]}, "listed twice"),
        ({"subnets": ["sn-1"]}, "not a subnet id"),
        ({"tags": {"spotrun:job": "x"}}, "set by spotrun"),
        ({"max_price": "cheap"}, "positive number"),
        ({"encrypted": False, "kms_key_id": "alias/x"}, "kms_key_id needs encrypted"),
        ({"allocation": "spread"}, "run-instances"),
        ({"instance_tyeps": ["g5.xlarge"]}, "Extra inputs"),
        ({"placement_group": True, "rehearse_locally": True}, "set placement_group: false to rehearse"),
    ],
)
def test_config_rejects(over: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError) as e:
        cfg(**over)
    assert says in str(e.value)


def test_config_fields_are_described() -> None:
    """The Prefect UI renders the model as a form: every field needs its help text."""
    missing = [name for name, f in AwsProviderConfig.model_fields.items() if not f.description]
    assert missing == []
    lt = cfg(image_id=None, launch_template={"id": "lt-0abc", "version": "3"}).launch_template
    assert lt is not None and lt.spec() == {"LaunchTemplateId": "lt-0abc", "Version": "3"}


# -- the launch requests -----------------------------------------------------------------------------

SPEC = "name: demo\nrecipe: digits\ntotal_steps: 10\nstorage: s3://bucket/jobs\n"


def test_user_data_is_valid_bash_carrying_the_spec() -> None:
    script = launch.build_user_data(
        SPEC,
        ["--max-steps", "5", "it's"],
        python="/opt/venv/bin/python",
        workdir="/opt/spot run",
        job="demo",
        attempt=3,
    )
    assert subprocess.run(["bash", "-n"], input=script, text=True, check=False).returncode == 0
    body = script.split("<<'SPOTRUN_JOB_B64'\n")[1].split("\nSPOTRUN_JOB_B64")[0]
    assert base64.b64decode(body).decode() == SPEC
    assert (
        'exec "$@" /opt/venv/bin/python -P -m spotrun.trainer --config job.yaml --worker-id '
        '"$SPOTRUN_WORKER_ID" '
        "--max-steps 5 'it'\"'\"'s'" in script
    )
    assert "SPOTRUN_HOME='/opt/spot run'" in script
    assert "X-aws-ec2-metadata-token" in script  # IMDSv2: the instance requires tokens
    assert launch.check_user_data(script) is None
    assert "over EC2's 16384" in (launch.check_user_data("x" * 20000) or "")


def test_run_instances_params_spot_and_on_demand() -> None:
    c = cfg(
        max_price="0.9",
        kms_key_id="alias/ckpt",
        instance_profile="arn:aws:iam::1:instance-profile/w",
        security_groups=["sg-1"],
        key_name="me",
        tags={"team": "ml"},
    )
    tags = launch.launch_tags(c, "demo", 2, launch_id="demo-a2-x", flow_run_id="flow-1")
    lease = float(tags.pop("spotrun:lease-until"))
    assert time.time() + c.lease_s - 5 < lease <= time.time() + c.lease_s
    assert tags == {
        "team": "ml",
        "Name": "spotrun-demo-a2",
        "spotrun:job": "demo",
        "spotrun:attempt": "2",
        "spotrun:worker": "demo-a2-x",
        "spotrun:flow-run": "flow-1",
    }
    p = launch.run_instances_params(
        c,
        Placement(B, AZS[B], "g6.xlarge"),
        "#!/bin/bash\n",
        tags=tags,
        launch_id="tok",
        root_device="/dev/xvda",
    )
    assert p["InstanceMarketOptions"] == {
        "MarketType": "spot",
        "SpotOptions": {
            "SpotInstanceType": "one-time",
            "InstanceInterruptionBehavior": "terminate",
            "MaxPrice": "0.9",
        },
    }
    assert p["MetadataOptions"]["HttpTokens"] == "required"
    assert p["BlockDeviceMappings"] == [
        {
            "DeviceName": "/dev/xvda",
            "Ebs": {
                "VolumeSize": 100,
                "VolumeType": "gp3",
                "DeleteOnTermination": True,
                "Encrypted": True,
                "KmsKeyId": "alias/ckpt",
            },
        }
    ]
    assert p["IamInstanceProfile"] == {"Arn": "arn:aws:iam::1:instance-profile/w"}
    assert (p["SubnetId"], p["InstanceType"], p["ClientToken"]) == (B, "g6.xlarge", "tok")
    assert [t["ResourceType"] for t in p["TagSpecifications"]] == ["instance", "volume"]
    od = launch.run_instances_params(
        c, Placement(None, None, "g5.xlarge", "on-demand"), "", tags={}, launch_id="t", root_device=None
    )
    assert "InstanceMarketOptions" not in od and "SubnetId" not in od and "BlockDeviceMappings" not in od
    assert launch.launch_tags(c, "demo", 1, launch_id="x", flow_run_id=None).get("spotrun:flow-run") is None


def test_fleet_params_and_template() -> None:
    c = cfg(allocation="fleet", max_price="1.5")
    pools = rank_placements(c, [], AZS, "spot")
    f = launch.fleet_params(c, "lt-1", pools, tags={"spotrun:job": "demo"}, market="spot")
    assert f["Type"] == "instant" and f["SpotOptions"]["AllocationStrategy"] == "price-capacity-optimized"
    assert f["TargetCapacitySpecification"] == {"TotalTargetCapacity": 1, "DefaultTargetCapacityType": "spot"}
    overrides = f["LaunchTemplateConfigs"][0]["Overrides"]
    assert len(overrides) == 6 and overrides[0] == {
        "InstanceType": "g5.xlarge",
        "SubnetId": A,
        "MaxPrice": "1.5",
    }
    od = launch.fleet_params(c, "lt-1", pools, tags={}, market="on-demand")
    assert od["OnDemandOptions"] == {"AllocationStrategy": "prioritized"} and "SpotOptions" not in od
    base = {"ImageId": "ami-1", "InstanceMarketOptions": {"MarketType": "spot"}, "UserData": "old"}
    data = launch.template_data(c, "#!/bin/bash\n", {"spotrun:job": "demo"}, root_device=None, base=base)
    assert "InstanceMarketOptions" not in data and base64.b64decode(data["UserData"]) == b"#!/bin/bash\n"


# -- how an instance ended, the heartbeat, the cost --------------------------------------------------


@pytest.mark.parametrize(
    ("state", "code", "released", "expected"),
    [
        (
            "terminated",
            "Server.SpotInstanceTermination",
            False,
            (SPOT_INTERRUPTION, KillReason.RECLAIMED, "Server.SpotInstanceTermination"),
        ),
        (
            "stopped",
            "Server.SpotInstanceShutdown",
            False,
            (SPOT_INTERRUPTION, KillReason.RECLAIMED, "Server.SpotInstanceShutdown"),
        ),
        (
            "terminated",
            "Client.UserInitiatedShutdown",
            True,
            (None, KillReason.RELEASE, "Client.UserInitiatedShutdown"),
        ),
        (
            "terminated",
            "Client.UserInitiatedShutdown",
            False,
            (None, KillReason.INSTANCE_GONE, "Client.UserInitiatedShutdown"),
        ),
        (
            "terminated",
            "Server.InternalError",
            False,
            (None, KillReason.INSTANCE_GONE, "Server.InternalError"),
        ),
        ("terminated", "", False, (None, KillReason.INSTANCE_GONE, "instance terminated")),
    ],
)
def test_end_of_instance(state: str, code: str, released: bool, expected: tuple[object, ...]) -> None:
    assert end_of_instance(state, code, released) == expected


def test_attempt_cost(tmp_path: Any) -> None:
    state = AwsWorkerState(
        "i-1",
        Placement(A, AZS[A], "g5.xlarge"),
        "x",
        launched_at=1000.0,
        price_per_h=0.36,
        on_demand_price_per_h=1.2,
        storage=LocalStorage(tmp_path),
    )
    assert attempt_cost(state, 1000.0 + 1800) == Cost(
        usd=0.18, price_per_h=0.36, market="spot", on_demand_usd=0.6, hours=0.5
    )
    unknown = AwsWorkerState(
        "i-2",
        Placement(A, AZS[A], "g5.xlarge"),
        "x",
        launched_at=0.0,
        price_per_h=None,
        on_demand_price_per_h=None,
        storage=LocalStorage(tmp_path),
    )
    assert attempt_cost(unknown, 3600) == Cost(None, None, "spot", on_demand_usd=None, hours=1.0)


@pytest.mark.parametrize(
    ("code", "marked"),
    [
        ("fulfilled", None),
        ("marked-for-termination", "marked-for-termination"),
        ("marked-for-stop", "marked-for-stop"),
        ("marked-for-hibernation", "marked-for-hibernation"),
        ("instance-terminated-by-price", None),  # already over: the instance state says so
        ("", None),
    ],
)
def test_spot_request_marked_for_interruption(code: str, marked: str | None) -> None:
    from spotrun.tasks.providers.aws.watch import spot_request_marked

    assert spot_request_marked({"Status": {"Code": code}}) == marked


# -- multi-node attempts -------------------------------------------------------------------------------

RUN = ("running", "")
SPOT = ("terminated", "Server.SpotInstanceTermination")
USER = ("shutting-down", "Client.UserInitiatedShutdown")
GONE = ("terminated", "not-found")
NODE1_RECLAIMED = (SPOT_INTERRUPTION, KillReason.RECLAIMED, "node 1: Server.SpotInstanceTermination")


@pytest.mark.parametrize(
    ("nodes", "released", "expected"),
    [
        ([RUN], False, None),
        ([RUN, RUN, RUN], False, None),
        ([SPOT], False, (SPOT_INTERRUPTION, KillReason.RECLAIMED, "Server.SpotInstanceTermination")),
        ([RUN, SPOT], False, NODE1_RECLAIMED),
        # the watch ended on node 1's reclaim; release then terminated node 0: the reclaim explains it
        ([USER, SPOT], True, NODE1_RECLAIMED),
        ([RUN, SPOT, SPOT], False, NODE1_RECLAIMED),
        ([USER, USER], True, (None, KillReason.RELEASE, "Client.UserInitiatedShutdown")),
        # someone terminated node 2 by hand: gone, not a release, and it outranks node 0's release
        ([USER, RUN, USER], False, (None, KillReason.INSTANCE_GONE, "Client.UserInitiatedShutdown")),
        ([RUN, RUN, GONE], False, (None, KillReason.INSTANCE_GONE, "node 2: not-found")),
        (
            [RUN, ("stopped", "Server.SpotInstanceShutdown")],
            False,
            (SPOT_INTERRUPTION, KillReason.RECLAIMED, "node 1: Server.SpotInstanceShutdown"),
        ),
    ],
)
def test_gang_end(nodes: list[tuple[str, str]], released: bool, expected: tuple[object, ...] | None) -> None:
    assert gang_end(nodes, released) == expected


@pytest.mark.parametrize(
    ("node", "home", "says", "not_says"),
    [
        (None, "SPOTRUN_HOME=/opt/spotrun/ ", [], ["SPOTRUN_NODE_RANK", "SPOTRUN_MASTER_ADDR"]),
        (
            launch.NodeRole(0, 2, None),
            "SPOTRUN_HOME=/opt/spotrun/node0 ",
            ["meta-data/local-ipv4", "export SPOTRUN_NODE_RANK=0 SPOTRUN_MASTER_ADDR"],
            [],
        ),
        (
            launch.NodeRole(3, 4, "10.0.1.7"),
            "SPOTRUN_HOME=/opt/spotrun/node3 ",
            ["SPOTRUN_MASTER_ADDR=${SPOTRUN_MASTER_ADDR:-10.0.1.7}", "export SPOTRUN_NODE_RANK=3 "],
            ["local-ipv4"],
        ),
    ],
)
def test_user_data_of_each_node(
    node: launch.NodeRole | None, home: str, says: list[str], not_says: list[str]
) -> None:
    script = launch.build_user_data(
        SPEC,
        ["--lease-takeover", "i-1"],
        python="python3",
        workdir="/opt/spotrun/",
        job="demo",
        attempt=2,
        node=node,
    )
    assert subprocess.run(["bash", "-n"], input=script, text=True, check=False).returncode == 0
    assert home in script and all(s in script for s in says) and not any(s in script for s in not_says)
    assert (
        'exec "$@" python3 -P -m spotrun.trainer --config job.yaml --worker-id "$SPOTRUN_WORKER_ID" '
        "--lease-takeover i-1" in script
    )


def test_node_address_already_set_wins(tmp_path: Any) -> None:
    """Run the node lines of the user data: a rehearsal's 127.0.0.1 wins over the private IP."""
    peer = launch.build_user_data(
        SPEC,
        [],
        python="true",
        workdir=str(tmp_path),
        job="d",
        attempt=1,
        node=launch.NodeRole(1, 2, "10.0.1.7"),
    )
    show = peer.replace(
        'exec "$@" true -P -m spotrun.trainer', 'echo "$SPOTRUN_NODE_RANK $SPOTRUN_MASTER_ADDR" #'
    )
    env = {"PATH": "/usr/bin:/bin", "SPOTRUN_WORKER_ID": "i-1", "SPOTRUN_TRAINER_USER": ""}
    out = subprocess.run(["bash"], input=show, text=True, capture_output=True, env=env, check=True)
    assert out.stdout == "1 10.0.1.7\n"
    env["SPOTRUN_MASTER_ADDR"] = "127.0.0.1"
    out = subprocess.run(["bash"], input=show, text=True, capture_output=True, env=env, check=True)
    assert out.stdout == "1 127.0.0.1\n" and (tmp_path / "node1" / "job.yaml").read_text() == SPEC


PROBE_OK = '[ "$2" = -c ] && exit 0  # the version check: this image has the controller\'s spotrun'
STUBS = {  # stand-ins that record their arguments: the test must not add a user to this host
    "id": "exit 1",  # no such user yet
    "useradd": "",
    "chown": "",
    "chmod": "",
    "setpriv": 'while [[ "$1" == --* ]]; do shift; done; exec "$@"',
}


@pytest.mark.parametrize(
    ("trainer_user", "calls", "home"),
    [
        (
            None,
            [
                "id -u spotrun",
                "useradd --system --user-group --no-create-home --home-dir {h} "
                "--shell /usr/sbin/nologin spotrun",
                "chown -R spotrun: {h}",
                "chmod 0700 {h}",
                "setpriv --reuid=spotrun --regid=spotrun --init-groups --no-new-privs python -P -m "
                "spotrun.trainer "
                "--config job.yaml --worker-id i-1",
            ],
            "{h}",
        ),
        ("", [], "/root-home"),  # a rehearsal: the current user runs the trainer
    ],
)
def test_user_data_runs_the_trainer_as_an_unprivileged_user(
    tmp_path: Path, trainer_user: str | None, calls: list[str], home: str
) -> None:
    """Run the user data with recording stand-ins for the commands that touch users and modes."""
    stubs, log, h = tmp_path / "bin", tmp_path / "calls.log", str(tmp_path / "w")
    stubs.mkdir()
    for name, body in {**STUBS, "python": f'{PROBE_OK}\necho "HOME=$HOME"'}.items():
        (stubs / name).write_text(f'#!/bin/bash\necho "{name} $*" >> {log}\n{body}\n')
        (stubs / name).chmod(0o755)
    script = launch.build_user_data(SPEC, [], python="python", workdir=h, job="d", attempt=1)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "SPOTRUN_WORKER_ID": "i-1", "HOME": "/root-home"}
    if trainer_user is not None:
        env["SPOTRUN_TRAINER_USER"] = trainer_user
    out = subprocess.run(["bash"], input=script, text=True, capture_output=True, env=env, check=True)
    recorded = log.read_text().splitlines() if log.exists() else []
    python = "python -P -m spotrun.trainer --config job.yaml --worker-id i-1"
    probe = f"python -P -c {launch.VERSION_PROBE} {spotrun_version()}"  # as root, before the switch
    assert recorded == [probe, *(c.format(h=h) for c in [*calls, python])]
    assert out.stdout == f"HOME={home.format(h=h)}\n"


def test_node_tags_and_placement_group_requests() -> None:
    c = cfg(placement_group=True)
    tags = launch.launch_tags(c, "demo", 2, launch_id="demo-a2-x", flow_run_id=None)
    assert launch.node_tags(tags, None) == tags
    one = launch.node_tags(tags, launch.NodeRole(1, 2, "10.0.0.4"))
    assert (one["Name"], one["spotrun:node"], one["spotrun:worker"]) == (
        "spotrun-demo-a2-n1",
        "1",
        "demo-a2-x",
    )
    name = launch.placement_group_name("demo-a2-x", 1)
    assert name == "spotrun-demo-a2-x-1"
    p = launch.run_instances_params(
        c,
        Placement(B, AZS[B], "g6.xlarge"),
        "",
        tags=one,
        launch_id="tok",
        root_device=None,
        placement_group=name,
    )
    assert p["Placement"] == {"GroupName": name} and p["SubnetId"] == B
    assert "Placement" not in launch.run_instances_params(
        c, Placement(B, AZS[B], "g6.xlarge"), "", tags=one, launch_id="t", root_device=None
    )
    data = launch.template_data(c, "#!/bin/bash\n", one, root_device=None, base=None, placement_group=name)
    assert data["Placement"] == {"GroupName": name}
    assert cfg().placement_group is False  # off unless asked


def test_multi_node_attempt_cost_counts_every_instance(tmp_path: Any) -> None:
    """provision stores the attempt's price (per instance x nodes): the cost needs no node count."""
    state = AwsWorkerState(
        instance_id="i-1",
        placement=Placement(A, AZS[A], "g5.xlarge"),
        launch_id="x",
        launched_at=0.0,
        price_per_h=2 * 0.36,
        on_demand_price_per_h=2 * 1.2,
        storage=LocalStorage(tmp_path),
        peers=["i-2"],
    )
    assert state.instance_ids == ["i-1", "i-2"]
    assert attempt_cost(state, 1800) == Cost(
        usd=0.36, price_per_h=0.72, market="spot", on_demand_usd=1.2, hours=0.5
    )


@pytest.mark.parametrize(("installed", "starts"), [("same", True), ("0.0.1", False), ("none", False)])
def test_user_data_refuses_an_image_with_another_spotrun(
    tmp_path: Path, installed: str, starts: bool
) -> None:
    """The image's spotrun is the worker's code: another version (or none) is named with the one needed,
    and no trainer starts."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    version = {"same": spotrun_version(), "0.0.1": "0.0.1", "none": ""}[installed]
    probe = f'[ "$2" = -c ] && {{ [ "$4" = "{version}" ]; exit $?; }}'  # $4: the version the check wants
    (stubs / "python").write_text(f"#!/bin/bash\n{probe}\necho TRAINER\n")
    (stubs / "python").chmod(0o755)
    script = launch.build_user_data(
        SPEC, [], python="python", workdir=str(tmp_path / "w"), job="d", attempt=1
    )
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "SPOTRUN_WORKER_ID": "i-1", "SPOTRUN_TRAINER_USER": ""}
    out = subprocess.run(["bash"], input=script, text=True, capture_output=True, env=env, check=False)
    if starts:
        assert out.returncode == 0 and out.stdout == "TRAINER\n", out.stderr
    else:
        assert out.returncode == 3 and "TRAINER" not in out.stdout
        need = spotrun_version()
        assert (
            f"this worker needs spotrun {need} on the image (python): pip install spotrun=={need}"
            in out.stderr
        )
