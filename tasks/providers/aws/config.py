"""The `aws` provider's settings: one typed model, validated at the edge, rendered as a form by Prefect."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from spotrun.trainer.checkpoint.signing import KEY_ENV

if TYPE_CHECKING:
    from typing import Self

    from spotrun.trainer.spec.job import JobSpec

RESERVED_TAG_PREFIX = "spotrun:"
_REGION = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d$")
_SUBNET = re.compile(r"^subnet-[0-9a-f]{8,17}$")


class LaunchTemplateRef(BaseModel):
    """An existing EC2 launch template, by name or id."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(default=None, description="launch template name (or set id)")
    id: str | None = Field(default=None, description="launch template id, lt-... (or set name)")
    version: str = Field(default="$Default", description="a version number, $Default or $Latest")

    @model_validator(mode="after")
    def _one_of(self) -> LaunchTemplateRef:
        if (self.name is None) == (self.id is None):
            raise ValueError("set exactly one of launch_template.name and launch_template.id")
        return self

    def spec(self) -> dict[str, str]:
        """The `LaunchTemplate` parameter of RunInstances / CreateFleet."""
        key = {"LaunchTemplateName": self.name} if self.name else {"LaunchTemplateId": self.id or ""}
        return {**key, "Version": self.version}


class RegionSettings(BaseModel):
    """One more region workers may run in, with what EC2 keeps per region: subnets, the AMI or launch
    template, security groups, the EBS key and the key pair. Everything else (instance types, the
    instance profile, the market settings) is the provider's, shared by every region."""

    model_config = ConfigDict(extra="forbid")

    region: str = Field(description="the region, e.g. us-east-1")
    subnets: list[str] = Field(
        default_factory=list,
        description="subnet ids there, one per availability zone, in order of preference; empty: the "
        "region's default VPC picks",
    )
    image_id: str | None = Field(default=None, description="the AMI there (AMIs are per region)")
    launch_template: LaunchTemplateRef | None = Field(
        default=None, description="a launch template there that supplies the AMI (or set image_id)"
    )
    security_groups: list[str] = Field(default_factory=list, description="security group ids there")
    kms_key_id: str | None = Field(
        default=None, description="the root volumes' KMS key there (keys are per region)"
    )
    key_name: str | None = Field(default=None, description="an EC2 key pair there; empty: none")

    @field_validator("region")
    @classmethod
    def _region_form(cls, v: str) -> str:
        return _region_name(v)

    @field_validator("subnets")
    @classmethod
    def _subnet_ids(cls, v: list[str]) -> list[str]:
        return _subnet_list(v)

    @model_validator(mode="after")
    def _one_image_source(self) -> RegionSettings:
        _image_source(self.image_id, self.launch_template, where=f"regions[{self.region}]: ")
        return self


def _region_name(v: str) -> str:
    if not _REGION.match(v):
        raise ValueError(f"{v!r} is not a region name: use one like ca-central-1 (not a zone like ...-1a)")
    return v


def _subnet_list(v: list[str]) -> list[str]:
    bad = [s for s in v if not _SUBNET.match(s)]
    if bad:
        raise ValueError(f"{bad[0]!r} is not a subnet id: use subnet-... ids, one per availability zone")
    if len(set(v)) != len(v):
        raise ValueError("a subnet is listed twice: list each once, in order of preference")
    return v


def _image_source(image_id: str | None, template: LaunchTemplateRef | None, where: str = "") -> None:
    if image_id is None and template is None:
        raise ValueError(f"{where}set image_id (an AMI) or launch_template")
    if image_id is not None and template is not None:
        raise ValueError(f"{where}set image_id or launch_template, not both (the template names its own AMI)")


class AwsProviderConfig(BaseModel):
    """Run each attempt on a fresh EC2 spot instance in one pinned region (or, opted in, one of
    `regions`)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["aws"] = Field(default="aws", description="selects this provider")
    region: str = Field(
        description="the region workers run in (data residency), e.g. ca-central-1; the checkpoint "
        "bucket should live there too. Its subnets, image and groups are the fields below"
    )
    regions: list[RegionSettings] = Field(
        default_factory=list,
        description="opt-in: more regions workers may also run in, in order of preference after "
        "`region`, each with its own subnets and image; a reclaim or a capacity refusal in one region "
        "moves the next attempt to another. Workers there read and write the one checkpoint bucket "
        "across regions (transfer charges; the data leaves `region`'s residency): empty, the default, "
        "keeps every worker in `region`",
    )
    instance_types: list[str] = Field(
        min_length=1,
        description="instance types in order of preference, e.g. [g5.xlarge, g6.xlarge, g4dn.xlarge]",
    )
    subnets: list[str] = Field(
        default_factory=list,
        description="subnet ids, one per availability zone, in order of preference; empty: the region's "
        "default VPC picks (and the provider cannot steer away from a preempted zone)",
    )
    image_id: str | None = Field(
        default=None, description="AMI with Python, torch and this project installed (or launch_template)"
    )
    launch_template: LaunchTemplateRef | None = Field(
        default=None, description="an existing launch template that supplies the AMI (or set image_id)"
    )
    instance_profile: str | None = Field(
        default=None,
        description="instance profile name or ARN whose role may read and write the checkpoint prefix",
    )
    security_groups: list[str] = Field(
        default_factory=list, description="security group ids (sg-...); workers need outbound HTTPS only"
    )
    root_volume_gb: int = Field(default=100, ge=8, le=16384, description="root EBS volume size (GiB)")
    encrypted: bool = Field(default=True, description="encrypt the root volume")
    kms_key_id: str | None = Field(
        default=None, description="KMS key (id, alias or ARN) for the root volume; empty: the EBS default key"
    )
    key_name: str | None = Field(default=None, description="EC2 key pair for SSH; empty: none")
    allocation: Literal["run-instances", "fleet"] = Field(
        default="run-instances",
        description="run-instances: try (subnet, type) pairs in the order the re-provision policy "
        "ranks them; fleet: one instant EC2 Fleet, price-capacity-optimized over all pairs",
    )
    spot_allocation_strategy: Literal[
        "price-capacity-optimized", "capacity-optimized", "capacity-optimized-prioritized"
    ] = Field(
        default="price-capacity-optimized",
        description="allocation: fleet only. price-capacity-optimized: the pools least likely to be "
        "interrupted, then the cheapest of them; capacity-optimized-prioritized: the pools with the most "
        "capacity, and among comparable ones the earlier of instance_types (each type's place in that "
        "list is its Priority); capacity-optimized: capacity alone",
    )
    placement_scores: bool = Field(
        default=True,
        description="order the subnets' zones by EC2's spot placement scores (GetSpotPlacementScores: "
        "one call per provisioning at most, cached) where the job's own history prefers none; an "
        "endpoint or identity that refuses the call means one warning and the configured order",
    )
    placement_scores_ttl_s: float = Field(
        default=600, ge=0, description="seconds a spot placement score is reused before EC2 is asked again"
    )
    rebalance_prewarm_s: float | None = Field(
        default=900,
        gt=180,
        description="at a rebalance recommendation (EC2's early warning, before the 2-minute notice) start "
        "the next worker and let it stand by this many seconds for the notice, while this one trains on; "
        "released unused if no notice comes. Empty: only the notice starts it",
    )
    placement_group: bool = Field(
        default=False,
        description="multi-node jobs: launch each attempt's instances into a cluster placement group of "
        "their own (lowest latency between nodes, but scarcer capacity); created per attempt, deleted "
        "once its instances are gone. Single-node jobs never use one",
    )
    max_price: str | None = Field(
        default=None, description="highest spot price in USD per hour, e.g. '0.9'; empty: the on-demand price"
    )
    on_demand_after_preemptions: int | None = Field(
        default=None, ge=1, description="switch to on-demand after this many spot preemptions; empty: never"
    )
    on_demand_after_s: float | None = Field(
        default=None,
        gt=0,
        description="switch to on-demand after this many seconds of failing to get spot capacity; "
        "empty: never",
    )
    provision_timeout_s: float = Field(
        default=600, gt=0, description="seconds a launched instance may take to reach `running`"
    )
    poll_s: float = Field(default=10, gt=0, description="seconds between looks at the instance and heartbeat")
    startup_timeout_s: float = Field(
        default=1200,
        gt=0,
        description="a running worker that has not started training this long (boot, imports, checkpoint "
        "download) is terminated and counted as lost",
    )
    heartbeat_timeout_s: float = Field(
        default=300,
        gt=0,
        description="once training has started, a worker whose heartbeat object does not change for "
        "this long is terminated and counted as lost",
    )
    lease_s: float = Field(
        default=900,
        ge=60,
        description="the flow renews each instance's `spotrun:lease-until` tag while it watches it; the "
        "sweeper terminates an instance whose lease ran out (its flow process died without a trace)",
    )
    endpoint_url: str | None = Field(
        default=None, description="an EC2-compatible endpoint (tests: a moto server); empty: AWS"
    )
    prewarm: bool = Field(
        default=True,
        description="at a spot notice, start the next attempt's worker at once: it builds the recipe "
        "while the old one saves, and resumes as soon as that checkpoint is durable",
    )
    warm: int = Field(
        default=0,
        ge=0,
        le=1,
        description="standby workers kept for the job (0 or 1: several would race for the one storage "
        "lease, and the controller could not tell which won): an instance launched when each attempt "
        "starts training, in another zone where the subnets allow, with the recipe built and its trainer "
        "waiting on the lease; a reclaim without notice hands the job to it at once. It is billed at the "
        "spot price while it waits (the attempt row's extra.warm, and the goodput report's cost). Needs "
        "prewarm; single-node jobs only",
    )
    warm_idle_s: float | None = Field(
        default=None,
        gt=0,
        description="a standby instance nobody used for this long is terminated, and the attempt goes on "
        "without one (its cost is capped at this much of a second instance per attempt); empty: it stands "
        "by as long as the attempt runs",
    )
    rehearse_locally: bool = Field(
        default=False,
        description="rehearsal against a test endpoint (moto): run each instance's user data as a local "
        "process, since such an endpoint starts nothing; never set it against AWS",
    )
    python: str = Field(
        default="python3", description="interpreter on the AMI that runs `-P -m spotrun.trainer`"
    )
    manifest_key_file: str | None = Field(
        default=None,
        description="a root-readable file on the instance (baked into the AMI, or written by its own boot "
        "from a secrets service) holding SPOTRUN_MANIFEST_KEY; the user data exports it for the trainer. "
        "Required when the controller has the key (spotrun puts no secret in user data)",
    )
    workdir: str = Field(
        default="/var/lib/spotrun",
        description="directory on the instance for the job file and local cache, owned by the trainer's "
        "unprivileged user: keep it apart from where the AMI installs the code",
    )
    tags: dict[str, str] = Field(
        default_factory=dict, description="extra tags on instances and volumes (cost allocation, owner)"
    )
    on_demand_price_per_h: dict[str, float] = Field(
        default_factory=dict,
        description="instance type -> on-demand USD per hour, for cost reports, the spot comparison and "
        "the budget check (types not named: a table of us-east-1 list prices, for the budget check only)",
    )

    @field_validator("region")
    @classmethod
    def _region_form(cls, v: str) -> str:
        return _region_name(v)

    @field_validator("subnets")
    @classmethod
    def _subnet_ids(cls, v: list[str]) -> list[str]:
        return _subnet_list(v)

    @field_validator("instance_types")
    @classmethod
    def _distinct_types(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("an instance type is listed twice: list each once, in order of preference")
        return v

    @field_validator("tags")
    @classmethod
    def _own_tags(cls, v: dict[str, str]) -> dict[str, str]:
        taken = [k for k in v if k.startswith(RESERVED_TAG_PREFIX) or k == "Name"]
        if taken:
            raise ValueError(f"tag {taken[0]!r} is set by spotrun: choose another key")
        return v

    @field_validator("max_price")
    @classmethod
    def _price(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                ok = float(v) > 0
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"max_price {v!r}: give USD per hour as a positive number, e.g. '0.9'")
        return v

    @model_validator(mode="after")
    def _one_image_source(self) -> AwsProviderConfig:
        _image_source(self.image_id, self.launch_template)
        self._check_regions()
        if self.kms_key_id and not self.encrypted:
            raise ValueError("kms_key_id needs encrypted: true")
        if self.spot_allocation_strategy != "price-capacity-optimized" and self.allocation != "fleet":
            raise ValueError(
                f"spot_allocation_strategy {self.spot_allocation_strategy}: only an EC2 Fleet allocates; "
                "set allocation: fleet, or leave spot_allocation_strategy out"
            )
        if self.warm and not self.prewarm:
            raise ValueError(
                "warm workers hand over as a prewarmed replacement does: set prewarm: true, or warm: 0"
            )
        if self.placement_group and self.rehearse_locally:
            raise ValueError(
                "placement_group: the rehearsal's test endpoint (moto 5) has no placement groups; "
                "set placement_group: false to rehearse"
            )
        return self

    def _check_regions(self) -> None:
        names = [self.region, *(r.region for r in self.regions)]
        if len(set(names)) != len(names):
            raise ValueError(
                "regions: a region is listed twice (or repeats `region`): list each once; `region`'s own "
                "subnets and image are the top-level fields"
            )
        if self.regions and self.allocation == "fleet":
            raise ValueError(
                "regions: an EC2 Fleet is per region, and spotrun does not yet make one per "
                "region; set allocation: run-instances, or leave regions out"
            )
        if self.regions and self.placement_group:
            raise ValueError("regions: placement_group is not built for several regions yet; leave one out")

    def region_names(self) -> list[str]:
        """`region`, then `regions` in their order."""
        return [self.region, *(r.region for r in self.regions)]

    def site(self, region: str | None) -> AwsProviderConfig:
        """These settings as seen from one region (None or `region`: unchanged): that region's subnets,
        image and groups in the top-level fields, so that what builds a launch reads one region."""
        if region is None or region == self.region:
            return self
        found = next((r for r in self.regions if r.region == region), None)
        if found is None:
            raise ValueError(f"region {region} is not configured: add it to regions")
        return self.model_copy(
            update={
                **found.model_dump(exclude={"launch_template"}),
                "launch_template": found.launch_template,
                "regions": [],
            }
        )

    # What the controller asks of any provider's settings (tasks/providers/base.py ProviderSettings).
    workers_here: ClassVar[bool] = False  # an EC2 image may hold what this machine lacks

    def workers_dir(self, default: Path) -> Path:
        """`default`: `workdir` is a directory on the instance, not here."""
        return default

    def placed(self, workdir: Path) -> Self:
        """Unchanged: the instances keep their files on their own disks."""
        return self

    def endpoints(self) -> dict[str, str | None]:
        """The EC2 endpoint (None: AWS's own)."""
        return {"provider.endpoint_url": self.endpoint_url}

    def deployment_refusal(self, is_loopback: Callable[[str], bool]) -> str | None:
        """A local rehearsal only against a loopback test endpoint: it runs instances' user data here."""
        if self.rehearse_locally and not (self.endpoint_url and is_loopback(self.endpoint_url)):
            return (
                "provider.rehearse_locally: only against a loopback test endpoint (moto on 127.0.0.1); "
                "set provider.endpoint_url to one, or turn rehearse_locally off"
            )
        return None

    def signing_refusal(self, job: JobSpec, environ: Mapping[str, str]) -> str | None:
        """The instance reads the key from its own file (the operator's word that it is there), or never
        gets it."""
        if self.manifest_key_file:
            return None
        return (
            f"{KEY_ENV} is set here, but EC2 workers do not get it (spotrun puts no secret in user data): "
            f"they would write checkpoints this controller cannot verify; set provider.manifest_key_file "
            f"to a file on the instance that holds it, or unset {KEY_ENV}"
        )
