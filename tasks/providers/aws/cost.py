"""What an attempt cost: the price in effect at launch (spot price history, or the configured on-demand
price) times the instance's runtime, beside what the same hours would have cost on demand."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from botocore import exceptions as bce

from spotrun.tasks.providers.aws.config import AwsProviderConfig
from spotrun.tasks.providers.aws.policy import Market, Placement
from spotrun.tasks.providers.aws.watch import AwsWorkerState

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Cost:
    """What one attempt's instance cost, at the price in effect when it launched."""

    usd: float | None  # None: the price is unknown
    price_per_h: float | None
    market: Market
    on_demand_usd: float | None  # the same hours at the on-demand price, when configured
    hours: float


def attempt_cost(state: AwsWorkerState, ended_at: float) -> Cost:
    """Launch-time price x runtime from launch to `ended_at`: an estimate, as the spot price may move
    while the instance runs."""
    hours = max(0.0, ended_at - state.launched_at) / 3600
    price, od = state.price_per_h, state.on_demand_price_per_h
    return Cost(
        usd=price * hours if price is not None else None,
        price_per_h=price,
        market=state.placement.market,
        on_demand_usd=od * hours if od is not None else None,
        hours=hours,
    )


def spot_price(ec2: EC2Client, instance_type: str, az: str | None) -> float | None:
    """The current Linux spot price of the type in the zone, or None if EC2 will not say."""
    where: dict[str, Any] = {"AvailabilityZone": az} if az else {}
    try:
        out = ec2.describe_spot_price_history(
            InstanceTypes=[instance_type],  # type: ignore[list-item]
            ProductDescriptions=["Linux/UNIX", "Linux/UNIX (Amazon VPC)"],
            StartTime=datetime.now(UTC),
            **where,
        )
    except (bce.ClientError, bce.BotoCoreError) as e:  # cost reports are best effort; the launch goes on
        log.warning("no spot price for %s in %s: %s", instance_type, az, e)
        return None
    rows = [r for r in out.get("SpotPriceHistory", []) if az is None or r.get("AvailabilityZone") == az]
    rows.sort(key=lambda r: r.get("Timestamp") or datetime.min.replace(tzinfo=UTC))
    return float(rows[-1]["SpotPrice"]) if rows and rows[-1].get("SpotPrice") else None


def launch_prices(
    ec2: EC2Client, cfg: AwsProviderConfig, where: Placement, nodes: int
) -> tuple[float | None, float | None]:
    """(price, on-demand price) per hour of an attempt of `nodes` instances that landed `where`: the
    spot price in its zone now (or the configured on-demand price), and the configured on-demand one."""
    od = cfg.on_demand_price_per_h.get(where.instance_type)
    price = spot_price(ec2, where.instance_type, where.az) if where.market == "spot" else od
    return _times(price, nodes), _times(od, nodes)


def _times(price: float | None, nodes: int) -> float | None:
    """An instance's price per hour for the whole attempt."""
    return None if price is None else price * nodes
