"""Where the next attempt runs: pure functions over the placements tried so far and how each went.

A pool is one (subnet, instance type); its subnet fixes its availability zone. A preemption or a
capacity error marks the pool, its zone and its type as recently bad, and pools are ranked by those
three marks (never bad first, then the longest ago), ties in the configured preference order (type
first, then subnet). With subnets [a, b, c] and types [g5, g6] that reads:

    a/g5 preempted -> b/g6 (another zone and type)
    b/g6 preempted -> c/g5 (the zone never hit; g5 was hit longer ago than g6)
    c/g5 no capacity -> a/g6 (every zone hit: the one hit longest ago)

Where the history gives no reason to prefer one zone, EC2's spot placement scores (1-10: how likely
a spot request of this size succeeds in that zone now) order the zones of one instance type before the
configured subnet order: the history is what this job met, the score is EC2's guess for everyone, so
the history ranks first. Type preference stays above both (the operator's order of instance types is a
choice about the job, not about the market). With subnets [a, b, c], types [g5] and scores
{a: 3, b: 9, c: 6}:

    nothing bad yet -> b/g5 (the best score)
    b/g5 preempted -> c/g5 (b is marked; c scores above a)

With more regions (`regions`, an opt-in) a pool also has a region, and a preemption or a capacity
error marks that region as well, ranked below the pool and the zone and above the type: zones of one
region often fail together. Ties keep the type order, then the score (zones of every region compare),
then the configured region order, then the subnet order. With `region` A (subnets a1, a2), `regions`
[B] (subnet b1) and one type:

    nothing bad yet -> a1 (the configured order)
    a1 no capacity -> b1 (A is hit; B is not)
    b1 preempted -> a2 (every region hit: A longest ago, and a2's zone never)

A rebalance recommendation (EC2's early warning, before any notice) marks its pool, zone and type as
a preemption does, so that a replacement started at it lands elsewhere, but counts toward no
on-demand fallback: nothing was taken back yet.

Spot turns to on-demand after `on_demand_after_preemptions` spot preemptions, or once spot launches
have been failing for capacity for `on_demand_after_s` seconds with no spot launch since the first
failure. Both are sticky: the run stays on on-demand (only a spot launch would end the streak).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from spotrun.tasks.market.fallback import FixedRule
from spotrun.tasks.providers.aws.config import AwsProviderConfig

Market = Literal["spot", "on-demand"]
NEVER = float("-inf")


@dataclass(frozen=True)
class Placement:
    """Where one instance was (or is to be) launched."""

    subnet: str | None  # None: the default VPC chose
    az: str | None  # the subnet's zone (or the zone the instance landed in)
    instance_type: str
    market: Market = "spot"
    region: str | None = None  # None: the config's `region`; else one of its `regions`

    def describe(self) -> str:
        where = self.az or self.subnet or (f"any zone of {self.region}" if self.region else "any zone")
        return f"{self.instance_type} {self.market} in {where}"


class PlacementOutcome(StrEnum):
    LAUNCHED = "launched"  # the instance reached `running`
    CAPACITY = "capacity"  # the launch was refused for lack of capacity
    FAILED = "failed"  # the launch was refused for another reason (transient or setup)
    PREEMPTED = "preempted"  # EC2 took the running instance back
    REBALANCE = "rebalance"  # EC2 recommended moving off the running instance (elevated risk)
    ENDED = "ended"  # the attempt ended otherwise: completed, crashed, lost, released


BAD = (PlacementOutcome.PREEMPTED, PlacementOutcome.CAPACITY, PlacementOutcome.REBALANCE)


@dataclass(frozen=True)
class PlacementEvent:
    """One line of the placement history the policy reads."""

    placement: Placement
    outcome: PlacementOutcome
    t: float  # epoch seconds
    error: str = ""  # the error kind or EC2 code, for launches that failed


def choose_market(cfg: AwsProviderConfig, history: list[PlacementEvent], now: float) -> Market:
    """Spot, unless the on-demand fallback rules say the spot market has had its chances."""
    rule = FixedRule(cfg.on_demand_after_preemptions, cfg.on_demand_after_s)
    preempted = sum(1 for e in history if e.outcome is PlacementOutcome.PREEMPTED)
    since = spot_shortage_since(history)
    short = None if since is None else now - since
    return "spot" if rule.on_demand_reason(preemptions=preempted, short_s=short) is None else "on-demand"


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
    cfg: AwsProviderConfig,
    history: list[PlacementEvent],
    azs: dict[str, str],
    market: Market,
    *,
    scores: Mapping[str, int] | None = None,
) -> list[Placement]:
    """Every pool for `market`, best first, over `region` and then `regions`. `azs` maps each subnet to
    its availability zone; `scores` each zone to its spot placement score (a zone without one ranks
    below those with one; zone names are unique across regions)."""
    bad = [e for e in history if e.outcome in BAD]
    ranked = []
    sites: list[tuple[str | None, list[str]]] = [
        (None, cfg.subnets),
        *((r.region, r.subnets) for r in cfg.regions),
    ]
    for ti, itype in enumerate(cfg.instance_types):
        for ri, (region, site_subnets) in enumerate(sites):
            subnets: list[str | None] = list(site_subnets) or [None]
            for si, subnet in enumerate(subnets):
                az = azs.get(subnet) if subnet else None
                score = (scores or {}).get(az or "", 0) if market == "spot" else 0
                pool = Placement(subnet, az, itype, market, region=region)
                ranked.append(((*_marks(bad, pool), ti, -score, ri, si), pool))
    ranked.sort(key=lambda kp: kp[0])
    return [p for _, p in ranked]


def _marks(bad: list[PlacementEvent], pool: Placement) -> tuple[float, ...]:
    """When the pool, its zone, its region and its type were last bad (NEVER if not yet): smaller ranks
    first. The region ranks below the zone and above the type: zones of one region often fail
    together, so once one is hit an unhit region goes before the hit region's other zones."""
    where = (pool.region, pool.subnet, pool.instance_type)
    same_pool = [
        e.t for e in bad if (e.placement.region, e.placement.subnet, e.placement.instance_type) == where
    ]
    zone = [e.t for e in bad if pool.az is not None and e.placement.az == pool.az]
    region = [e.t for e in bad if e.placement.region == pool.region]
    family = [e.t for e in bad if e.placement.instance_type == pool.instance_type]
    return tuple(max(ts, default=NEVER) for ts in (same_pool, zone, region, family))


def apart_from(pools: list[Placement], zones: set[str]) -> list[Placement]:
    """`pools` with those outside `zones` first, each part in its order: a warm standby goes where the
    running worker is not, so that one zone's reclaim cannot take both (a pool of unknown zone counts as
    apart)."""
    return sorted(pools, key=lambda p: p.az is not None and p.az in zones)


def next_placement(
    cfg: AwsProviderConfig,
    history: list[PlacementEvent],
    azs: dict[str, str],
    now: float,
    scores: Mapping[str, int] | None = None,
) -> Placement:
    """The pool and market the next launch tries first."""
    return rank_placements(cfg, history, azs, choose_market(cfg, history, now), scores=scores)[0]


def zone_scores(response: Mapping[str, Any], zone_names: Mapping[str, str]) -> dict[str, int]:
    """GetSpotPlacementScores' answer (SingleAvailabilityZone) as zone name -> score. EC2 names zones
    by id (use1-az4: the same physical zone in every account); `zone_names` maps the ids of the
    configured subnets' zones to their names in this account. Zones not configured are dropped; a
    zone listed twice keeps its best score."""
    out: dict[str, int] = {}
    for row in response.get("SpotPlacementScores") or []:
        name = zone_names.get(str(row.get("AvailabilityZoneId") or ""))
        score = row.get("Score")
        if name is None or not isinstance(score, int):
            continue
        out[name] = max(score, out.get(name, score))
    return out
