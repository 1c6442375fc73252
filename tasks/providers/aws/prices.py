"""What an hour of an EC2 worker costs before anything launches: the prices the budget check at
submission reads (`provider.prices`, tasks/deadlines/plan.py), so that `budget_usd` is checked on EC2
as on the local trace replay.

- Spot: DescribeSpotPriceHistory's newest price for each (instance type, zone) of the configured types
  in the zones the job may run in, every region of the config asked once; the cheapest of them. The
  check refuses a job only when even that price cannot pay for it, so a lower bound keeps the refusal
  sound (the spot price moves; the attempt's own cost, cost.py, is looked up again at its launch).
- On-demand: `on_demand_price_per_h` where the config names the type, else ON_DEMAND_LIST_PRICES, a
  small table of AWS list prices for common GPU types (Linux, us-east-1, as published on the EC2
  on-demand pricing page in 2025; other regions cost up to ~30% more). It serves the budget warning
  only: an attempt's recorded on-demand comparison (cost.py) uses the configured prices alone. Name
  your region's prices in the config. The cheapest configured type that has a price is used.

Both are per instance: a K-node job's check counts one instance (a lower bound again).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from botocore import exceptions as bce

from spotrun.tasks.market.prices import Prices
from spotrun.tasks.providers.aws.config import AwsProviderConfig
from spotrun.tasks.providers.aws.errors import LaunchContext, classify_error

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client

log = logging.getLogger(__name__)

# USD per hour, Linux on-demand, us-east-1 (AWS list prices). Not fetched: the Price List API is a
# second service, and a stale table is still a sound fallback for a warning.
ON_DEMAND_LIST_PRICES: Mapping[str, float] = {
    "g4dn.xlarge": 0.526,
    "g4dn.2xlarge": 0.752,
    "g4dn.4xlarge": 1.204,
    "g4dn.12xlarge": 3.912,
    "g5.xlarge": 1.006,
    "g5.2xlarge": 1.212,
    "g5.4xlarge": 1.624,
    "g5.12xlarge": 5.672,
    "g6.xlarge": 0.8048,
    "g6.2xlarge": 0.9776,
    "p3.2xlarge": 3.06,
    "p3.8xlarge": 12.24,
    "p3.16xlarge": 24.48,
}
LINUX = ["Linux/UNIX", "Linux/UNIX (Amazon VPC)"]


def on_demand_price(cfg: AwsProviderConfig, instance_type: str) -> float | None:
    """USD per hour on-demand: the config's price, else the list-price table, else None."""
    return cfg.on_demand_price_per_h.get(instance_type, ON_DEMAND_LIST_PRICES.get(instance_type))


def newest_spot(
    rows: Iterable[Mapping[str, Any]], zones: set[str] | None = None
) -> dict[tuple[str, str], float]:
    """(instance type, zone) -> the newest spot price among DescribeSpotPriceHistory rows; only `zones`
    when given."""
    newest: dict[tuple[str, str], tuple[datetime, float]] = {}
    oldest = datetime.min.replace(tzinfo=UTC)
    for r in rows:
        key = (str(r.get("InstanceType") or ""), str(r.get("AvailabilityZone") or ""))
        if not r.get("SpotPrice") or (zones is not None and key[1] not in zones):
            continue
        t = r.get("Timestamp") or oldest
        if key not in newest or t >= newest[key][0]:
            newest[key] = (t, float(r["SpotPrice"]))
    return {k: price for k, (_, price) in newest.items()}


def cheapest(spot: Mapping[tuple[str, str], float], on_demand: Iterable[float | None]) -> Prices | None:
    """The cheapest hour on each market; None when either is unknown (the budget check then waits)."""
    known = [p for p in on_demand if p is not None]
    if not spot or not known:
        return None
    return Prices(spot_per_h=min(spot.values()), on_demand_per_h=min(known))


def quote(cfg: AwsProviderConfig, clients: Mapping[str, EC2Client], zones: set[str] | None) -> Prices | None:
    """The prices the budget check uses: one DescribeSpotPriceHistory per region in `clients`, over
    `zones` (zone names are unique across regions; None: every zone). None, with a warning, when EC2
    will not say."""
    rows: list[Mapping[str, Any]] = []
    for region, ec2 in clients.items():
        try:
            out = ec2.describe_spot_price_history(
                InstanceTypes=list(cfg.instance_types),  # type: ignore[arg-type]
                ProductDescriptions=LINUX,
                StartTime=datetime.now(UTC),
            )
        except (bce.ClientError, bce.BotoCoreError) as e:  # the check waits; the launch does not
            found = classify_error(e, LaunchContext(region, ",".join(cfg.instance_types)))
            log.warning("no spot prices for the budget check: %s", found.message)
            return None
        rows += out.get("SpotPriceHistory") or []
    prices = cheapest(newest_spot(rows, zones), [on_demand_price(cfg, t) for t in cfg.instance_types])
    if prices is None:
        log.warning(
            "no prices for the budget check (spot history empty, or no on-demand price for %s): set "
            "on_demand_price_per_h",
            ", ".join(cfg.instance_types),
        )
    return prices
