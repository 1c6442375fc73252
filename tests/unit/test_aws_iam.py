"""The generated IAM policies as tables (moto does not enforce IAM): which statements each setting
brings, the instance-type allow-list, the installation tag every launch, terminate and retag requires,
the worker's one-job prefix, and the refusals."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from spotrun.tasks.providers.aws.config import AwsProviderConfig
from spotrun.tasks.providers.aws.iam import Scope, controller_policy, main, worker_policy
from spotrun.trainer.errors import ConfigError

ID = "0123456789abcdef"
ACCOUNT = "123456789012"
KEY = "arn:aws:kms:ca-central-1:123456789012:key/k-1"
SCOPE = Scope(ACCOUNT, ID, "s3://bucket/jobs")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "aws.md"
BASE: dict[str, Any] = {
    "region": "ca-central-1",
    "instance_types": ["g5.xlarge", "g6.xlarge"],
    "subnets": ["subnet-0000000a", "subnet-0000000b"],
    "image_id": "ami-0123456789abcdef0",
    "instance_profile": "spotrun-worker",
    "security_groups": ["sg-0123"],
}


def cfg(**over: Any) -> AwsProviderConfig:
    return AwsProviderConfig.model_validate({**BASE, **over})


def by_sid(policy: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["Sid"]: s for s in policy["Statement"]}


def actions(s: dict[str, Any]) -> list[str]:
    return [s["Action"]] if isinstance(s["Action"], str) else list(s["Action"])


def resources(s: dict[str, Any]) -> list[str]:
    return [s["Resource"]] if isinstance(s["Resource"], str) else list(s["Resource"])


CORE = [
    "LaunchAllowedTypes",
    "LaunchTaggedVolumes",
    "LaunchFromThese",
    "TagOnlyAtLaunch",
    "EndOwnWorkers",
    "RenewLeasesOfOwnWorkers",
    "Look",
    "CheckpointList",
    "CheckpointUploads",
    "CheckpointObjects",
]


@pytest.mark.parametrize(
    ("over", "scope", "extra", "launch_actions"),
    [
        ({}, SCOPE, ["HandWorkersTheirRole"], ["ec2:RunInstances"]),
        ({"instance_profile": None}, SCOPE, [], ["ec2:RunInstances"]),
        (
            {"allocation": "fleet"},
            SCOPE,
            ["FleetTemplates", "HandWorkersTheirRole"],
            ["ec2:RunInstances", "ec2:CreateFleet"],
        ),
        ({"placement_group": True}, SCOPE, ["PlacementGroups", "HandWorkersTheirRole"], ["ec2:RunInstances"]),
        (
            {"kms_key_id": "alias/ebs"},
            SCOPE,
            ["HandWorkersTheirRole", "EncryptedRootVolumes", "EncryptedRootVolumeGrants"],
            ["ec2:RunInstances"],
        ),
        (
            {},
            Scope(ACCOUNT, ID, "s3://bucket/jobs", KEY),
            ["HandWorkersTheirRole", "CheckpointKey"],
            ["ec2:RunInstances"],
        ),
    ],
)
def test_each_setting_brings_its_statements(
    over: dict[str, Any], scope: Scope, extra: list[str], launch_actions: list[str]
) -> None:
    policy = controller_policy(cfg(**over), scope)
    assert sorted(by_sid(policy)) == sorted([*CORE, *extra])
    assert actions(by_sid(policy)["LaunchAllowedTypes"]) == launch_actions


@pytest.mark.parametrize(
    ("sid", "operator", "key", "value"),
    [
        ("LaunchAllowedTypes", "StringEquals", "ec2:InstanceType", ["g5.xlarge", "g6.xlarge"]),
        ("LaunchAllowedTypes", "StringEquals", "aws:RequestTag/spotrun:installation", ID),
        ("LaunchAllowedTypes", "StringLike", "aws:RequestTag/spotrun:job", "?*"),
        ("LaunchAllowedTypes", "StringEquals", "aws:RequestedRegion", "ca-central-1"),
        ("LaunchTaggedVolumes", "StringEquals", "aws:RequestTag/spotrun:installation", ID),
        ("LaunchFromThese", "StringEquals", "aws:RequestedRegion", "ca-central-1"),
        ("TagOnlyAtLaunch", "StringEquals", "ec2:CreateAction", ["RunInstances"]),
        ("EndOwnWorkers", "StringEquals", "ec2:ResourceTag/spotrun:installation", ID),
        ("RenewLeasesOfOwnWorkers", "StringEquals", "ec2:ResourceTag/spotrun:installation", ID),
        ("RenewLeasesOfOwnWorkers", "ForAllValues:StringEquals", "aws:TagKeys", ["spotrun:lease-until"]),
        ("HandWorkersTheirRole", "StringEquals", "iam:PassedToService", "ec2.amazonaws.com"),
        ("CheckpointList", "StringLike", "s3:prefix", ["jobs/*"]),
    ],
)
def test_conditions(sid: str, operator: str, key: str, value: object) -> None:
    assert by_sid(controller_policy(cfg(), SCOPE))[sid]["Condition"][operator][key] == value


@pytest.mark.parametrize(
    "over", [{}, {"allocation": "fleet"}, {"placement_group": True}, {"kms_key_id": "k-1"}]
)
def test_every_launch_terminate_and_retag_names_this_installation(over: dict[str, Any]) -> None:
    """Whatever the settings: instances launch only as allowed types with this installation's tag; what
    ends or retags a resource requires the tag on it; tags are otherwise set only by a launch; only
    Describe* runs on every resource."""
    for s in controller_policy(cfg(**over), SCOPE)["Statement"]:
        cond, acts = s.get("Condition", {}), actions(s)
        if "ec2:RunInstances" in acts and any(r.endswith(":instance/*") for r in resources(s)):
            assert cond["StringEquals"]["ec2:InstanceType"] == ["g5.xlarge", "g6.xlarge"]
        creates = any(a.startswith("ec2:Create") and a != "ec2:CreateTags" for a in acts)
        if creates and s["Sid"] != "LaunchFromThese":  # that one: the image, subnets, groups referenced
            assert cond["StringEquals"]["aws:RequestTag/spotrun:installation"] == ID
        if any(a.startswith(("ec2:Terminate", "ec2:Delete", "ec2:GetConsole")) for a in acts):
            assert cond["StringEquals"]["ec2:ResourceTag/spotrun:installation"] == ID
        if "ec2:CreateTags" in acts:
            assert "ec2:CreateAction" in cond["StringEquals"] or (
                cond["StringEquals"]["ec2:ResourceTag/spotrun:installation"] == ID
                and cond["ForAllValues:StringEquals"]["aws:TagKeys"] == ["spotrun:lease-until"]
            )
        if "*" in resources(s):
            # read-only looks: Describe*, and the placement scores (advice, no resource)
            assert all(a.startswith("ec2:Describe") or a == "ec2:GetSpotPlacementScores" for a in acts)


@pytest.mark.parametrize(
    ("key", "resource", "condition"),
    [
        (KEY, KEY, None),
        ("k-1", KEY, None),
        ("alias/ebs", "arn:aws:kms:ca-central-1:123456789012:key/*", ["alias/ebs"]),
        (
            "arn:aws:kms:ca-central-1:123456789012:alias/ebs",
            "arn:aws:kms:ca-central-1:123456789012:key/*",
            ["alias/ebs"],
        ),
    ],
)
def test_the_root_volume_key(key: str, resource: str, condition: list[str] | None) -> None:
    found = by_sid(controller_policy(cfg(kms_key_id=key), SCOPE))
    use, grant = found["EncryptedRootVolumes"], found["EncryptedRootVolumeGrants"]
    assert use["Resource"] == grant["Resource"] == resource
    assert grant["Condition"]["Bool"] == {"kms:GrantIsForAWSResource": "true"}
    aliases = use.get("Condition", {}).get("ForAnyValue:StringEquals", {}).get("kms:ResourceAliases")
    assert aliases == condition


def test_the_worker_reaches_one_jobs_prefix_only() -> None:
    policy = worker_policy("s3://bucket/jobs/my-job/", KEY)
    found = by_sid(policy)
    assert found["JobList"]["Condition"] == {"StringLike": {"s3:prefix": ["jobs/my-job/*"]}}
    assert found["JobObjects"]["Resource"] == "arn:aws:s3:::bucket/jobs/my-job/*"
    assert found["JobKey"]["Resource"] == KEY
    assert not any(a.startswith(("ec2:", "iam:")) for s in policy["Statement"] for a in actions(s))


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda: worker_policy("s3://bucket"), "name a prefix under the bucket, e.g. s3://bucket/jobs"),
        (lambda: worker_policy("s3://bucket//"), "name a prefix under the bucket"),
        (lambda: worker_policy("/data/ckpt"), "give an s3://bucket/prefix URI"),
        (lambda: worker_policy("s3://b/j", "alias/s3"), "give the key's ARN"),
        (lambda: Scope("1234", ID, "s3://b/j"), "give the 12-digit AWS account id"),
        (lambda: Scope(ACCOUNT, ID, "s3://b/j", worker_role="arn:aws:iam::1:role/x"), "not its ARN"),
    ],
)
def test_refusals_say_what_to_give(make: Any, says: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        make()


def test_the_command_prints_json_or_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPOTRUN_HOME", str(tmp_path / "home"))
    provider = tmp_path / "provider.yaml"
    provider.write_text(json.dumps({"kind": "aws", **BASE}))
    args = ["controller", "--provider", str(provider), "--account", ACCOUNT, "--storage", "s3://b/j"]
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    installation = (tmp_path / "home" / "aws-installation-id").read_text().strip()
    ours = by_sid(printed)["EndOwnWorkers"]["Condition"]["StringEquals"]
    assert ours["ec2:ResourceTag/spotrun:installation"] == installation
    provider.write_text("kind: aws\nregion: ca-central-1a\n")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"spotrun: {provider}: not valid aws provider settings") and err.count("\n") == 1


def _docs_block(heading: str, fence: str) -> str:
    """The first `fence` block after `heading` in docs/aws.md, dedented."""
    text = DOCS.read_text().split(heading, 1)[1]
    return textwrap.dedent(text.split(f"```{fence}\n", 1)[1].split("```", 1)[0])


def test_the_docs_show_the_generated_policies() -> None:
    """docs/aws.md's policies are this module's output for its walkthrough's provider settings."""
    walkthrough = AwsProviderConfig.model_validate(yaml.safe_load(_docs_block("**Provider config**", "yaml")))
    key = "arn:aws:kms:ca-central-1:123456789012:key/S3-KEY-ID"
    scope = Scope(ACCOUNT, ID, "s3://BUCKET/jobs", key)
    assert json.loads(_docs_block("### Controller", "json")) == controller_policy(walkthrough, scope)
    assert json.loads(_docs_block("### Worker", "json")) == worker_policy("s3://BUCKET/jobs/my-job", key)


@pytest.mark.parametrize("scores", [True, False])
def test_placement_scores_bring_their_one_read_only_action(scores: bool) -> None:
    look = by_sid(controller_policy(cfg(placement_scores=scores), SCOPE))["Look"]
    assert ("ec2:GetSpotPlacementScores" in actions(look)) is scores
