"""Where an instance may go: the regions, each with its EC2 client, its subnets' zones and its AMI's
root device (looked up once, and checked on the way), and EC2's spot placement scores of the zones.

`rank` orders the (subnet, instance type) pools with the re-provision policy (policy.py), which reads
the job's placement history and the scores: asked once per provisioning at most, cached for
`placement_scores_ttl_s`; a refusal is one warning and the configured order.

Several regions (`regions`, an opt-in): the pools of every region are ranked together (policy.py: the
job's history marks regions as it marks zones), one placement-score call names them all, and each
launch, watch, release and sweep goes through its region's client (`client`). Checkpoints stay in the
one bucket, which a worker in another region reads across regions (docs/aws.md: the cost, and data
residency).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from spotrun.tasks.providers.aws.config import AwsProviderConfig
from spotrun.tasks.providers.aws.errors import (
    BOTO_ERRORS,
    SCORES_ERRORS,
    LaunchContext,
    classify_code,
    classify_error,
    scores_refusal,
)
from spotrun.tasks.providers.aws.policy import Market, Placement, PlacementEvent, rank_placements, zone_scores

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client

log = logging.getLogger(__name__)


class Sites:
    """The regions of one provider and what EC2 says of their zones; see the module docstring."""

    def __init__(self, cfg: AwsProviderConfig, clients: Mapping[str, EC2Client]) -> None:
        self.cfg = cfg
        self.clients: dict[str, EC2Client] = dict(clients)  # one per region
        if missing := [r for r in cfg.region_names() if r not in self.clients]:
            raise ValueError(f"no EC2 client for region(s) {', '.join(missing)}: pass regions_ec2")
        self._azs: dict[str, str] | None = None
        self._zone_names: dict[str, str] = {}  # the subnets' zone ids (use1-az4) -> names (us-east-1a)
        self._scores: dict[int, tuple[float, dict[str, int]]] = {}  # nodes -> (asked at, zone -> score)
        self._scores_warned = False
        self._roots: dict[str | None, str | None] = {}  # region (None: `region`) -> the AMI's root device

    def client(self, region: str | None) -> EC2Client:
        """The EC2 client of `region` (None: the config's `region`)."""
        return self.clients[region or self.cfg.region]

    def lookups(self) -> tuple[dict[str, str], dict[str | None, str | None]]:
        """The subnets' zones and each region's AMI root device name (None: `region`'s), looked up once
        (and checked on the way)."""
        regions: list[str | None] = [None, *(r.region for r in self.cfg.regions)]
        if self._azs is None:
            subnets = [s for region in regions for s in self._subnets(region)]
            self._azs = {s["SubnetId"]: s["AvailabilityZone"] for s in subnets}
            self._zone_names = {
                s["AvailabilityZoneId"]: s["AvailabilityZone"] for s in subnets if s.get("AvailabilityZoneId")
            }
        for region in regions:
            if region not in self._roots:
                self._roots[region] = self._root_device(region)
        return self._azs, self._roots

    def rank(
        self, history: list[PlacementEvent], azs: dict[str, str], market: Market, nnodes: int
    ) -> list[Placement]:
        """Every pool for `market`, best first: the policy over the history and the zones' scores."""
        return rank_placements(self.cfg, history, azs, market, scores=self.scores(nnodes, market))

    def scores(self, nnodes: int, market: Market) -> dict[str, int]:
        """Zone name -> EC2's spot placement score for `nnodes` instances of the configured types, asked
        at most once per `placement_scores_ttl_s`; {} when turned off, on-demand, one zone, or refused."""
        if not self.cfg.placement_scores or market != "spot" or len(set(self._zone_names.values())) < 2:
            return {}
        now = time.monotonic()
        cached = self._scores.get(nnodes)
        if cached is not None and now - cached[0] < self.cfg.placement_scores_ttl_s:
            return cached[1]
        try:
            out = self.client(None).get_spot_placement_scores(
                InstanceTypes=list(self.cfg.instance_types),
                TargetCapacity=nnodes,
                TargetCapacityUnitType="units",
                SingleAvailabilityZone=True,
                RegionNames=self.cfg.region_names(),  # one call scores the zones of every region
            )
            scores = zone_scores(out, self._zone_names)  # type: ignore[arg-type]
            log.info(
                "spot placement scores for %d x %s: %s", nnodes, ",".join(self.cfg.instance_types), scores
            )
        except SCORES_ERRORS as e:  # advice only: the configured order serves
            scores = {}
            (log.debug if self._scores_warned else log.warning)("%s", scores_refusal(e, self.cfg.region))
            self._scores_warned = True
        self._scores[nnodes] = (now, scores)
        return scores

    def ctx(self, pool: Placement | None, region: str | None = None) -> LaunchContext:
        """What an error line names: the pool's (or `region`'s) region, type, image, subnet, profile."""
        cfg = self.cfg.site(pool.region if pool else region)
        lt = cfg.launch_template
        image = cfg.image_id or (lt.name or lt.id or "" if lt else "")
        itype = pool.instance_type if pool else ",".join(cfg.instance_types)
        subnet = pool.subnet if pool else None
        return LaunchContext(cfg.region, itype, image, subnet=subnet, instance_profile=cfg.instance_profile)

    def _subnets(self, region: str | None) -> list[Any]:
        """The region's configured subnets as EC2 lists them ([] for none: the default VPC)."""
        site = self.cfg.site(region)
        if not site.subnets:
            return []
        try:
            return list(self.client(region).describe_subnets(SubnetIds=site.subnets)["Subnets"])
        except BOTO_ERRORS as e:
            raise classify_error(e, self.ctx(None, region)).error() from e

    def _root_device(self, region: str | None) -> str | None:
        """The root device name of the region's AMI (None: a launch template names its own)."""
        site = self.cfg.site(region)
        if site.image_id is None:
            return None
        ctx = self.ctx(None, region)
        try:
            images = self.client(region).describe_images(ImageIds=[site.image_id]).get("Images", [])
        except BOTO_ERRORS as e:
            raise classify_error(e, ctx).error() from e
        if not images:
            raise classify_code("InvalidAMIID.NotFound", "", ctx).error()
        return images[0].get("RootDeviceName") or "/dev/xvda"
