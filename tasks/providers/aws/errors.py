"""Every EC2 error the provider can meet, mapped in one place to a kind and one line that says the fix.

A capacity error is the spot market's weather: retryable, and the re-provision policy tries another
(subnet, instance type) or falls back to on-demand. A transient error (throttling, a 5xx, a dropped
connection) is retryable where it stands. Everything else (quota, a bad AMI or instance type, a missing
subnet or profile, credentials, permissions) will fail the same way until a person fixes the setup, so
it stops the run with a line that names the problem and the fix.

GetSpotPlacementScores is advice, never a reason to stop or wait: `scores_refusal` maps its every
failure to the one warning line after which the provider keeps the configured zone order.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from botocore import exceptions as bce
from botocore.parsers import ResponseParserError

from spotrun.tasks.providers.base import ProvisionError


class ErrorKind(StrEnum):
    CAPACITY = "capacity"  # no spot (or on-demand) capacity for this pool now: try elsewhere
    TRANSIENT = "transient"  # throttled, 5xx, connection: try again
    QUOTA = "quota"
    IMAGE = "image"
    INSTANCE_TYPE = "instance-type"
    AUTH = "auth"
    CONFIG = "config"  # a subnet, security group, key pair, profile or template that does not exist
    UNKNOWN = "unknown"


BOTO_ERRORS = (bce.ClientError, bce.BotoCoreError)  # what any EC2 call may raise
# What a GetSpotPlacementScores call may raise: botocore's errors, and a reply that is not EC2's.
SCORES_ERRORS = (bce.ClientError, bce.BotoCoreError, ResponseParserError)
RETRYABLE = frozenset({ErrorKind.CAPACITY, ErrorKind.TRANSIENT})

CAPACITY_CODES = frozenset(
    {
        "InsufficientInstanceCapacity",
        "InsufficientCapacity",
        "InsufficientHostCapacity",
        "InsufficientReservedInstanceCapacity",
        "InsufficientCapacityOnOutpost",
        "UnfulfillableCapacity",  # fleet: no pool could take the request
        "SpotMaxPriceTooLow",
        # The region's spot vCPU quota: no other pool helps, but the on-demand fallback may.
        "MaxSpotInstanceCountExceeded",
        "Unsupported",  # "instance type not supported in the requested availability zone"
        "Server.InsufficientInstanceCapacity",  # StateReason of a launch that failed while pending
    }
)
TRANSIENT_CODES = frozenset(
    {
        "RequestLimitExceeded",
        "Throttling",
        "ThrottlingException",
        "InternalError",
        "InternalFailure",
        "ServiceUnavailable",
        "Unavailable",
        "IdempotentParameterMismatch",  # a retried launch raced its own first try
    }
)
QUOTA_CODES = frozenset({"InstanceLimitExceeded", "VcpuLimitExceeded", "MaxFleetCountExceeded"})
AUTH_CODES = frozenset(
    {
        "AuthFailure",
        "UnauthorizedOperation",
        "InvalidClientTokenId",
        "SignatureDoesNotMatch",
        "OptInRequired",
        "ExpiredToken",
        "RequestExpired",
        "AccessDenied",
        "AccessDeniedException",
    }
)
CONFIG_PREFIXES = (
    "InvalidSubnetID",
    "InvalidSubnet",
    "InvalidGroup",
    "InvalidSecurityGroupID",
    "InvalidKeyPair",
    "InvalidLaunchTemplate",
    "InvalidBlockDeviceMapping",
    "InvalidParameterCombination",
    "InvalidParameterValue",
    "InvalidParameter",
    "NoSuchEntity",  # moto: the instance profile does not exist
    "InvalidKMSKey",
    "KMSKeyNotAccessible",
)
NO_CREDENTIALS = (
    "no AWS credentials: set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
    "or run on an instance with a role"
)


@dataclass(frozen=True)
class LaunchContext:
    """What the failing request asked for, so the message can name it."""

    region: str
    instance_type: str = ""
    image: str = ""  # image_id or the launch template's name
    subnet: str | None = None
    instance_profile: str | None = None


@dataclass(frozen=True)
class Classified:
    kind: ErrorKind
    code: str
    message: str  # one line: the problem and the fix

    @property
    def retryable(self) -> bool:
        return self.kind in RETRYABLE

    def error(self) -> ProvisionError:
        return ProvisionError(self.message, retryable=self.retryable)


def error_code(e: BaseException) -> str:
    """The AWS error code of a ClientError ("" for anything else)."""
    if isinstance(e, bce.ClientError):
        return str(e.response.get("Error", {}).get("Code") or "")
    return ""


def classify_error(e: BaseException, ctx: LaunchContext) -> Classified:
    """Map a botocore exception (or an error code in a fleet's error list) to a kind and one line."""
    if isinstance(e, bce.NoCredentialsError | bce.PartialCredentialsError):
        return Classified(ErrorKind.AUTH, type(e).__name__, NO_CREDENTIALS)
    if isinstance(e, bce.EndpointConnectionError | bce.ConnectionError | bce.HTTPClientError):
        return Classified(ErrorKind.TRANSIENT, type(e).__name__, f"cannot reach EC2 in {ctx.region}: {e}")
    if isinstance(e, bce.ClientError):
        err = e.response.get("Error", {})
        status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        return classify_code(str(err.get("Code") or ""), str(err.get("Message") or ""), ctx, status)
    return Classified(ErrorKind.UNKNOWN, type(e).__name__, f"EC2 call failed in {ctx.region}: {e}")


def classify_code(code: str, message: str, ctx: LaunchContext, status: int = 400) -> Classified:
    """The same mapping for a bare (code, message), as CreateFleet reports its errors."""
    kind = _kind(code, message)
    if kind is ErrorKind.UNKNOWN and status >= 500:
        kind = ErrorKind.TRANSIENT
    return Classified(kind, code, _line(kind, code, _first_line(message), ctx))


def _kind(code: str, message: str) -> ErrorKind:
    text = message.lower()
    if code in CAPACITY_CODES or (code == "InvalidParameterValue" and "not supported in" in text):
        return ErrorKind.CAPACITY
    if code in TRANSIENT_CODES:
        return ErrorKind.TRANSIENT
    if code in QUOTA_CODES:
        return ErrorKind.QUOTA
    if code.startswith("InvalidAMIID"):
        return ErrorKind.IMAGE
    if code.startswith("InvalidInstanceType") or (
        code == "InvalidParameterValue" and "instancetype" in text.replace(" ", "")
    ):
        return ErrorKind.INSTANCE_TYPE
    if code in AUTH_CODES:
        return ErrorKind.AUTH
    if code.startswith(CONFIG_PREFIXES):
        return ErrorKind.CONFIG
    return ErrorKind.UNKNOWN


def _line(kind: ErrorKind, code: str, message: str, ctx: LaunchContext) -> str:
    where, itype = ctx.region, ctx.instance_type
    if kind is ErrorKind.CAPACITY:
        pool = f"{itype} in {ctx.subnet or where}"
        return f"no capacity for {pool} ({code}): trying other zones and instance types"
    if kind is ErrorKind.TRANSIENT:
        return f"EC2 in {where} is throttling or unavailable ({code}): {message}"
    if kind is ErrorKind.QUOTA:
        return (
            f"EC2 quota reached in {where} for {itype} ({code}): request a vCPU increase in Service Quotas "
            "(Running On-Demand/Spot instances of that family) or choose smaller instance_types"
        )
    if kind is ErrorKind.IMAGE:
        return (
            f"EC2 has no usable AMI {ctx.image!r} in {where} ({code}): check image_id (AMIs are per region)"
        )
    if kind is ErrorKind.INSTANCE_TYPE:
        return f"EC2 rejected instance type {itype!r} in {where}: check instance_types"
    if kind is ErrorKind.AUTH:
        return (
            f"AWS refused the request in {where} ({code}): check the credentials, and that the identity "
            "has the EC2, iam:PassRole and S3 permissions in docs/aws.md"
        )
    if kind is ErrorKind.CONFIG:
        fix = _config_fix(code, message, ctx)
        return f"EC2 rejected the launch settings in {where} ({code}: {message}): {fix}"
    return f"EC2 call failed in {where} ({code or 'no code'}): {message}"


def _config_fix(code: str, message: str, ctx: LaunchContext) -> str:
    if code == "NoSuchEntity" or "instanceprofile" in message.lower().replace(" ", ""):
        return f"check instance_profile ({ctx.instance_profile!r} must exist)"
    if code.startswith("InvalidSubnet"):
        return f"check subnets (subnet {ctx.subnet} must exist in {ctx.region})"
    if code.startswith(("InvalidGroup", "InvalidSecurityGroup")):
        return "check security_groups (ids of groups in the subnets' VPC)"
    if code.startswith("InvalidKeyPair"):
        return "check key_name"
    if code.startswith("InvalidLaunchTemplate"):
        return "check launch_template (name or id, and version)"
    if code.startswith(("InvalidKMSKey", "KMSKeyNotAccessible")):
        return "check kms_key_id and that the caller may use the key (kms:CreateGrant)"
    return "check the provider settings"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:300] if text.strip() else ""


def scores_refusal(e: BaseException, region: str) -> str:
    """The one warning line for a GetSpotPlacementScores call that gave nothing; provisioning goes on in
    the configured zone order."""
    tail = "zones in the configured order"
    if isinstance(e, ResponseParserError):  # moto answers an action it lacks with an HTML 500 page
        return (
            f"the EC2 endpoint in {region} does not serve GetSpotPlacementScores (a test endpoint?): {tail}"
        )
    found = classify_error(e, LaunchContext(region))
    if found.kind is ErrorKind.AUTH:
        return (
            f"spot placement scores refused in {region} ({found.code}): allow ec2:GetSpotPlacementScores "
            f"(`spotrun iam` prints the policy) or set placement_scores: false; {tail}"
        )
    if found.kind is ErrorKind.TRANSIENT:
        return f"spot placement scores unavailable in {region} ({found.code}): {tail} this time"
    detail = f"{found.code or type(e).__name__}: {_first_line(str(e))}"
    return f"spot placement scores not available in {region} ({detail}): {tail}"
