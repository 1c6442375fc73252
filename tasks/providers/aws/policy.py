"""Where the next attempt runs: pure functions over the placements tried so far and how each went.

A pool is one (subnet, instance type); its subnet fixes its availability zone. A preemption or a
capacity error marks the pool, its zone and its type as recently bad, and pools are ranked by those
three marks (never bad first, then the longest ago), ties in the configured preference order (type
first, then subnet). With subnets [a, b, c] and types [g5, g6] that reads:

    a/g5 preempted -> b/g6 (another zone and type)
    b/g6 preempted -> c/g5 (the zone never hit; g5 was hit longer ago than g6)
    c/g5 no capacity -> a/g6 (every zone hit: the one hit longest ago)

Spot turns to on-demand after `on_demand_after_preemptions` spot preemptions, or once spot launches
have been failing for capacity for `on_demand_after_s` seconds with no spot launch since the first
failure. Both are sticky: the run stays on on-demand (only a spot launch would end the streak).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from tasks.providers.aws.config import AwsProviderConfig

Market = Literal["spot", "on-demand"]
NEVER = float("-inf")


@dataclass(frozen=True)
class Placement:
    """Where one instance was (or is to be) launched."""

    subnet: str | None  # None: the default VPC chose
    az: str | None  # the subnet's zone (or the zone the instance landed in)
    instance_type: str
    market: Market = "spot"

    def describe(self) -> str:
        return f"{self.instance_type} {self.market} in {self.az or self.subnet or 'any zone'}"


class PlacementOutcome(StrEnum):
    LAUNCHED = "launched"  # the instance reached `running`
    CAPACITY = "capacity"  # the launch was refused for lack of capacity
    FAILED = "failed"  # the launch was refused for another reason (transient or setup)
    PREEMPTED = "preempted"  # EC2 took the running instance back
    ENDED = "ended"  # the attempt ended otherwise: completed, crashed, lost, released


BAD = (PlacementOutcome.PREEMPTED, PlacementOutcome.CAPACITY)


@dataclass(frozen=True)
class PlacementEvent:
    """One line of the placement history the policy reads."""

    placement: Placement
    outcome: PlacementOutcome
    t: float  # epoch seconds
    error: str = ""  # the error kind or EC2 code, for launches that failed


def choose_market(cfg: AwsProviderConfig, history: list[PlacementEvent], now: float) -> Market:
    """Spot, unless the on-demand fallback rules say the spot market has had its chances."""
    preempted = sum(1 for e in history if e.outcome is PlacementOutcome.PREEMPTED)
    if cfg.on_demand_after_preemptions is not None and preempted >= cfg.on_demand_after_preemptions:
        return "on-demand"
    since = spot_shortage_since(history)
    if cfg.on_demand_after_s is not None and since is not None and now - since >= cfg.on_demand_after_s:
        return "on-demand"
    return "spot"


def spot_shortage_since(history: list[PlacementEvent]) -> float | None:
    """When the current run of spot capacity failures began (None: the last spot launch succeeded)."""
    since: float | None = None
    for e in sorted(history, key=lambda e: e.t):
        if e.placement.market != "spot":
            continue
        if e.outcome is PlacementOutcome.LAUNCHED:
            since = None
        elif e.outcome is PlacementOutcome.CAPACITY and since is None:
            since = e.t
    return since


def rank_placements(
    cfg: AwsProviderConfig, history: list[PlacementEvent], azs: dict[str, str], market: Market
) -> list[Placement]:
    """Every pool for `market`, best first. `azs` maps each subnet to its availability zone."""
    bad = [e for e in history if e.outcome in BAD]
    ranked = []
    subnets: list[str | None] = list(cfg.subnets) or [None]
    for ti, itype in enumerate(cfg.instance_types):
        for si, subnet in enumerate(subnets):
            az = azs.get(subnet) if subnet else None
            key = (*_marks(bad, subnet, az, itype), ti, si)
            ranked.append((key, Placement(subnet, az, itype, market)))
    ranked.sort(key=lambda kp: kp[0])
    return [p for _, p in ranked]


def _marks(bad: list[PlacementEvent], subnet: str | None, az: str | None, itype: str) -> tuple[float, ...]:
    """When the pool, its zone and its type were last bad (NEVER if not yet): smaller ranks first."""
    pool = [e.t for e in bad if (e.placement.subnet, e.placement.instance_type) == (subnet, itype)]
    zone = [e.t for e in bad if az is not None and e.placement.az == az]
    family = [e.t for e in bad if e.placement.instance_type == itype]
    return tuple(max(ts, default=NEVER) for ts in (pool, zone, family))


def next_placement(
    cfg: AwsProviderConfig, history: list[PlacementEvent], azs: dict[str, str], now: float
) -> Placement:
    """The pool and market the next launch tries first."""
    return rank_placements(cfg, history, azs, choose_market(cfg, history, now))[0]
