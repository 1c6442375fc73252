"""The least-privilege IAM policies of one installation, generated from its provider settings (pure).

The controller may launch only the configured instance types, only from the configured image, subnets
and security groups, only with this installation's `spotrun:installation` tag in the request, and may
terminate, retag (the lease) and read the console of only instances that carry that tag: another
installation in the same account, or anything else there, is out of its reach. Tags can be set only as
part of a launch (`ec2:CreateAction`), so no existing resource can be tagged into scope.

A worker may read and write only its own job's storage prefix (which holds every run of the job), never
another job's. moto does not enforce IAM: tests/unit/test_aws_iam.py tests these documents as tables.

    python -m tasks.providers.aws.iam controller --provider provider.yaml --account 123456789012 \\
        --storage s3://BUCKET/jobs [--s3-key KEY-ARN] [--worker-role spotrun-worker]
    python -m tasks.providers.aws.iam worker --storage s3://BUCKET/jobs/my-job [--s3-key KEY-ARN]

The controller's document names this host's installation id (SPOTRUN_HOME): generate it there.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from spotrun.tasks.providers.aws.config import AwsProviderConfig
from spotrun.tasks.providers.aws.launch import TAG_INSTALLATION, TAG_JOB, TAG_LEASE
from spotrun.trainer.errors import ConfigError

Statement = dict[str, Any]
_ACCOUNT = re.compile(r"^\d{12}$")
_KMS_KEY_ARN = re.compile(r"^arn:aws[a-z-]*:kms:[a-z0-9-]+:\d{12}:key/[A-Za-z0-9-]+$")
_ROLE = re.compile(r"^[\w+=,.@-]{1,64}$")


@dataclass(frozen=True)
class Scope:
    """What the controller's policy names beyond the provider settings."""

    account: str  # the 12-digit AWS account id
    installation: str  # this installation's id (installation.py)
    storage: str  # s3://bucket/prefix: every job's storage lies under it
    s3_key: str | None = None  # the KMS key ARN the bucket encrypts with (SSE-KMS)
    worker_role: str = "spotrun-worker"  # the role behind `instance_profile`

    def __post_init__(self) -> None:
        if not _ACCOUNT.match(self.account):
            raise ConfigError(f"account {self.account!r}: give the 12-digit AWS account id")
        if not _ROLE.match(self.worker_role):
            raise ConfigError(f"worker role {self.worker_role!r}: give the role's name, not its ARN")
        _s3_key(self.s3_key)
        s3_scope(self.storage)


def s3_scope(storage: str) -> tuple[str, str]:
    """(bucket, key prefix without slashes) of an s3:// storage URI; a bucket root is refused."""
    if not storage.startswith("s3://"):
        raise ConfigError(f"storage {storage!r}: give an s3://bucket/prefix URI")
    bucket, _, prefix = storage.removeprefix("s3://").partition("/")
    if not bucket or not prefix.strip("/"):
        raise ConfigError(f"storage {storage!r}: name a prefix under the bucket, e.g. s3://{bucket}/jobs")
    return bucket, prefix.strip("/")


def _s3_key(key: str | None) -> str | None:
    if key is not None and not _KMS_KEY_ARN.match(key):
        raise ConfigError(f"s3 key {key!r}: give the key's ARN (arn:aws:kms:REGION:ACCOUNT:key/ID)")
    return key


def document(statements: list[Statement]) -> dict[str, Any]:
    return {"Version": "2012-10-17", "Statement": statements}


def worker_policy(storage: str, s3_key: str | None = None) -> dict[str, Any]:
    """The worker role's permissions: one job's storage prefix (every run of the job lies under it)."""
    return document(s3_statements(storage, _s3_key(s3_key), "Job"))


def s3_statements(storage: str, s3_key: str | None, sid: str) -> list[Statement]:
    """List, read, write and delete under `storage`'s prefix, and its objects' KMS key."""
    bucket, prefix = s3_scope(storage)
    out: list[Statement] = [
        {
            "Sid": f"{sid}List",
            "Effect": "Allow",
            "Action": "s3:ListBucket",
            "Resource": f"arn:aws:s3:::{bucket}",
            "Condition": {"StringLike": {"s3:prefix": [f"{prefix}/*"]}},
        },
        {  # takes no s3:prefix condition; it lists upload ids and keys, not data
            "Sid": f"{sid}Uploads",
            "Effect": "Allow",
            "Action": "s3:ListBucketMultipartUploads",
            "Resource": f"arn:aws:s3:::{bucket}",
        },
        {
            "Sid": f"{sid}Objects",
            "Effect": "Allow",
            "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
            "Resource": f"arn:aws:s3:::{bucket}/{prefix}/*",
        },
    ]
    if s3_key is not None:
        out.append(
            {
                "Sid": f"{sid}Key",
                "Effect": "Allow",
                "Action": ["kms:GenerateDataKey", "kms:Decrypt"],
                "Resource": s3_key,
            }
        )
    return out


def controller_policy(cfg: AwsProviderConfig, scope: Scope) -> dict[str, Any]:
    """The controller's permissions for these provider settings (the flow and the sweeper). With
    `regions`, the EC2 and EBS-key statements are made for each region from that region's own subnets,
    image, groups and key, each Sid suffixed with its region (CaCentral1); IAM and S3 are global."""
    sites = [(cfg.site(r), r if cfg.regions else None) for r in cfg.region_names()]
    return document(
        [
            *(
                s
                for site, r in sites
                for s in _in_region([*_launch(site, scope), *_own_workers(site, scope)], r)
            ),
            *(s for site, r in sites for s in _in_region([_look(site)], r)),
            *_pass_role(cfg, scope),
            *(s for site, r in sites for s in _in_region(_ebs_key(site, scope), r)),
            *s3_statements(scope.storage, scope.s3_key, "Checkpoint"),
        ]
    )


def _in_region(statements: list[Statement], region: str | None) -> list[Statement]:
    """The statements with their Sids suffixed by `region` (None: as they are), unique in one document."""
    if region is None:
        return statements
    suffix = "".join(part.capitalize() for part in region.split("-"))
    return [{**s, "Sid": s["Sid"] + suffix} for s in statements]


def _arn(cfg: AwsProviderConfig, scope: Scope, resource: str) -> str:
    return f"arn:aws:ec2:{cfg.region}:{scope.account}:{resource}"


def _launch(cfg: AwsProviderConfig, scope: Scope) -> list[Statement]:
    """Launch only allowed types, tagged with this installation, from the configured resources."""
    fleet = cfg.allocation == "fleet"
    actions = ["ec2:RunInstances", *(["ec2:CreateFleet"] if fleet else [])]
    region = {"aws:RequestedRegion": cfg.region}
    tagged = {f"aws:RequestTag/{TAG_INSTALLATION}": scope.installation, **region}
    has_job = {"StringLike": {f"aws:RequestTag/{TAG_JOB}": "?*"}}
    image = f"arn:aws:ec2:{cfg.region}::image/{cfg.image_id or '*'}"  # a launch template names its own
    referenced = [
        image,
        *[_arn(cfg, scope, f"subnet/{s}") for s in cfg.subnets or ["*"]],
        *[_arn(cfg, scope, f"security-group/{g}") for g in cfg.security_groups or ["*"]],
        _arn(cfg, scope, "network-interface/*"),
        _arn(cfg, scope, "spot-instances-request/*"),
        *([_arn(cfg, scope, "launch-template/*")] if fleet or cfg.launch_template else []),
        *([_arn(cfg, scope, f"key-pair/{cfg.key_name}")] if cfg.key_name else []),
        *([_arn(cfg, scope, "placement-group/*")] if cfg.placement_group else []),
    ]
    created = [_arn(cfg, scope, "volume/*"), *([_arn(cfg, scope, "fleet/*")] if fleet else [])]
    out: list[Statement] = [
        {
            "Sid": "LaunchAllowedTypes",
            "Effect": "Allow",
            "Action": actions,
            "Resource": _arn(cfg, scope, "instance/*"),
            "Condition": {
                "StringEquals": {**tagged, "ec2:InstanceType": list(cfg.instance_types)},
                **has_job,
            },
        },
        {
            "Sid": "LaunchTaggedVolumes",
            "Effect": "Allow",
            "Action": actions,
            "Resource": created,
            "Condition": {"StringEquals": tagged, **has_job},
        },
        {
            "Sid": "LaunchFromThese",
            "Effect": "Allow",
            "Action": actions,
            "Resource": referenced,
            "Condition": {"StringEquals": region},
        },
    ]
    creates = ["RunInstances", *(["CreateFleet", "CreateLaunchTemplate"] if fleet else [])]
    taggable = [_arn(cfg, scope, "instance/*"), *created]
    if fleet:
        taggable.append(_arn(cfg, scope, "launch-template/*"))
        out.append(
            {
                "Sid": "FleetTemplates",
                "Effect": "Allow",
                "Action": "ec2:CreateLaunchTemplate",
                "Resource": _arn(cfg, scope, "launch-template/*"),
                "Condition": {"StringEquals": tagged, **has_job},
            }
        )
    if cfg.placement_group:
        creates.append("CreatePlacementGroup")
        taggable.append(_arn(cfg, scope, "placement-group/*"))
        out.append(
            {
                "Sid": "PlacementGroups",
                "Effect": "Allow",
                "Action": "ec2:CreatePlacementGroup",
                "Resource": _arn(cfg, scope, "placement-group/*"),
                "Condition": {"StringEquals": tagged, **has_job},
            }
        )
    out.append(
        {
            "Sid": "TagOnlyAtLaunch",
            "Effect": "Allow",
            "Action": "ec2:CreateTags",
            "Resource": taggable,
            "Condition": {"StringEquals": {"ec2:CreateAction": creates, **region}},
        }
    )
    return out


def _own_workers(cfg: AwsProviderConfig, scope: Scope) -> list[Statement]:
    """Terminate, read the console of and renew the lease of this installation's instances only."""
    own = {f"ec2:ResourceTag/{TAG_INSTALLATION}": scope.installation, "aws:RequestedRegion": cfg.region}
    ends = [("ec2:TerminateInstances", "instance/*"), ("ec2:GetConsoleOutput", "instance/*")]
    if cfg.allocation == "fleet":
        ends.append(("ec2:DeleteLaunchTemplate", "launch-template/*"))
    if cfg.placement_group:
        ends.append(("ec2:DeletePlacementGroup", "placement-group/*"))
    return [
        {
            "Sid": "EndOwnWorkers",
            "Effect": "Allow",
            "Action": [a for a, _ in ends],
            "Resource": sorted({_arn(cfg, scope, r) for _, r in ends}),
            "Condition": {"StringEquals": own},
        },
        {
            "Sid": "RenewLeasesOfOwnWorkers",
            "Effect": "Allow",
            "Action": "ec2:CreateTags",
            "Resource": _arn(cfg, scope, "instance/*"),
            "Condition": {"StringEquals": own, "ForAllValues:StringEquals": {"aws:TagKeys": [TAG_LEASE]}},
        },
    ]


def _look(cfg: AwsProviderConfig) -> Statement:
    """Describe* calls cannot be scoped to resources; the region condition still applies."""
    actions = [
        "ec2:DescribeInstances",
        "ec2:DescribeSubnets",
        "ec2:DescribeImages",
        "ec2:DescribeSpotPriceHistory",
        "ec2:DescribeSpotInstanceRequests",
    ]
    if cfg.allocation == "fleet" or cfg.launch_template:
        actions.append("ec2:DescribeLaunchTemplateVersions")
    if cfg.placement_scores:  # advice on zones; refused, the provider keeps the configured order
        actions.append("ec2:GetSpotPlacementScores")
    return {
        "Sid": "Look",
        "Effect": "Allow",
        "Action": actions,
        "Resource": "*",
        "Condition": {"StringEquals": {"aws:RequestedRegion": cfg.region}},
    }


def _pass_role(cfg: AwsProviderConfig, scope: Scope) -> list[Statement]:
    if not cfg.instance_profile:
        return []
    return [
        {
            "Sid": "HandWorkersTheirRole",
            "Effect": "Allow",
            "Action": "iam:PassRole",
            "Resource": f"arn:aws:iam::{scope.account}:role/{scope.worker_role}",
            "Condition": {"StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}},
        }
    ]


def _ebs_key(cfg: AwsProviderConfig, scope: Scope) -> list[Statement]:
    """The root volumes' KMS key, when `kms_key_id` names one (an id, an ARN or an alias); grants only
    on behalf of EBS."""
    key = cfg.kms_key_id
    if not key:
        return []
    by_alias: dict[str, Any] = {}
    if key.startswith("arn:") and ":key/" in key:
        resource = key
    elif key.startswith("alias/") or ":alias/" in key:
        resource = f"arn:aws:kms:{cfg.region}:{scope.account}:key/*"
        by_alias = {"ForAnyValue:StringEquals": {"kms:ResourceAliases": ["alias/" + key.split("alias/")[1]]}}
    else:
        resource = f"arn:aws:kms:{cfg.region}:{scope.account}:key/{key}"
    use = ["kms:Decrypt", "kms:DescribeKey", "kms:GenerateDataKeyWithoutPlaintext", "kms:ReEncrypt*"]
    grant = {"Bool": {"kms:GrantIsForAWSResource": "true"}, **by_alias}
    return [
        {
            "Sid": "EncryptedRootVolumes",
            "Effect": "Allow",
            "Action": use,
            "Resource": resource,
            **({"Condition": by_alias} if by_alias else {}),
        },
        {
            "Sid": "EncryptedRootVolumeGrants",
            "Effect": "Allow",
            "Action": "kms:CreateGrant",
            "Resource": resource,
            "Condition": grant,
        },
    ]


def main(argv: list[str] | None = None) -> int:
    """Print one policy document as JSON; bad input is one line on stderr and exit code 2."""
    parser = argparse.ArgumentParser(
        prog="python -m tasks.providers.aws.iam", description="Print a least-privilege IAM policy (JSON)."
    )
    sub = parser.add_subparsers(dest="role", required=True)
    ctl = sub.add_parser("controller", help="the identity the flow and the sweeper run as")
    ctl.add_argument("--provider", required=True, type=Path, help="the aws provider settings (YAML)")
    ctl.add_argument("--account", required=True, help="the 12-digit AWS account id")
    ctl.add_argument("--worker-role", default="spotrun-worker", help="the role behind instance_profile")
    wrk = sub.add_parser("worker", help="the role behind instance_profile, for one job")
    for p, what in ((ctl, "every job's storage lies under it"), (wrk, "the job's storage")):
        p.add_argument("--storage", required=True, help=f"s3://bucket/prefix: {what}")
        p.add_argument("--s3-key", help="the ARN of the KMS key the bucket encrypts with")
    args = parser.parse_args(argv)
    try:
        if args.role == "worker":
            policy = worker_policy(args.storage, args.s3_key)
        else:
            policy = controller_policy(_provider(args.provider), _scope(args))
    except (ConfigError, OSError) as e:
        print(f"spotrun: {e}", file=sys.stderr)
        return 2
    print(json.dumps(policy, indent=2))
    return 0


def _provider(path: Path) -> AwsProviderConfig:
    try:
        return AwsProviderConfig.model_validate(yaml.safe_load(path.read_text()))
    except (ValidationError, yaml.YAMLError) as e:
        first = str(e).splitlines()[:3]
        raise ConfigError(f"{path}: not valid aws provider settings: {' '.join(first)}") from e


def _scope(args: argparse.Namespace) -> Scope:
    from spotrun.tasks.providers.aws.installation import installation_id
    from spotrun.trainer.home import spotrun_home

    home = spotrun_home()
    return Scope(
        args.account, installation_id(home), args.storage, s3_key=args.s3_key, worker_role=args.worker_role
    )


if __name__ == "__main__":
    sys.exit(main())
