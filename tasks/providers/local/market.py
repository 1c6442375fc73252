"""The local provider's spot market when it replays a capacity trace: which zone a spot worker starts in,
when its zone's capacity is gone, what an hour costs.

Real measurements (tasks/market/traces.py) rather than random draws make a rehearsal meet the market a
job will meet: long calm stretches, then hours in which every zone of a region is empty at once. The
replay runs on the wall clock from the provider's first provision, `compress` times faster than the
trace was taken:

    tick = trace_start_tick + int((now - t0) / (gap_seconds / compress))

Every method takes `now`; nothing here reads a clock, so the rules are tested with a fake one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotrun.tasks.market.traces import Trace, best_zone, load
from spotrun.tasks.providers.base import Market, ProvisionError

if TYPE_CHECKING:
    from spotrun.tasks.providers.local.config import LocalProviderConfig

ON_DEMAND_ZONE = ""  # on-demand has no zone in the replay: it is always there


@dataclass
class TraceMarket:
    """Capacity per zone per tick from `traces` (one clock, as measured), replayed `compress` times faster."""

    traces: Sequence[Trace]
    compress: float = 1.0
    start_tick: int = 0
    spot_price_per_h: float = 0.0
    on_demand_price_per_h: float = 0.0
    t0: float | None = None  # when the replay began: the first placement

    @classmethod
    def of(cls, cfg: LocalProviderConfig) -> TraceMarket | None:
        """The replay these settings ask for, or None (no `trace`: the schedule or random simulator)."""
        if cfg.trace is None:
            return None
        return cls(
            traces=load(Path(cfg.trace), cfg.zones),
            compress=cfg.compress,
            start_tick=cfg.trace_start_tick,
            spot_price_per_h=cfg.spot_price_per_h,
            on_demand_price_per_h=cfg.on_demand_price_per_h,
        )

    @property
    def zones(self) -> list[str]:
        return [t.zone for t in self.traces]

    def tick(self, now: float) -> int:
        """The trace tick at `now` (the start tick until the replay has begun)."""
        if self.t0 is None:
            return self.start_tick
        elapsed = max(0.0, now - self.t0)
        return self.start_tick + int(elapsed * self.compress / self.traces[0].gap_s)

    def capacity(self, zone: str, tick: int) -> int:
        """Spot instances `zone` could give at `tick`."""
        return next(t.at(tick) for t in self.traces if t.zone == zone)

    def place(self, market: Market, now: float) -> str:
        """The zone a worker on `market` starts in at `now` (the replay's clock starts at the first
        call); ProvisionError (retryable) when no zone has spot capacity."""
        if self.t0 is None:
            self.t0 = now
        if market == "on-demand":
            return ON_DEMAND_ZONE
        tick = self.tick(now)
        caps = [t.at(tick) > 0 for t in self.traces]
        if not any(caps):
            raise ProvisionError(
                f"no spot capacity in {', '.join(self.zones)} at trace tick {tick}; will try again "
                "(on-demand is always there)",
                retryable=True,
            )
        return self.traces[best_zone(self.traces, tick, caps)].zone

    def reclaimed_at(self, market: Market, zone: str, now: float) -> int | None:
        """The tick at which a worker on `market` in `zone` has lost its capacity, or None while it keeps
        it (on-demand always does)."""
        if market != "spot":
            return None
        tick = self.tick(now)
        return tick if self.capacity(zone, tick) == 0 else None

    def price_per_h(self, market: Market) -> float:
        return self.spot_price_per_h if market == "spot" else self.on_demand_price_per_h

    def cost(self, market: Market, zone: str, *, started_at: float, ended_at: float) -> dict[str, Any]:
        """One worker's price times its wall hours, in the shape the AWS provider stores
        (tasks/providers/aws/cost.py `Cost`, plus the zone), for the attempts table and the summary."""
        hours = max(0.0, ended_at - started_at) / 3600
        price = self.price_per_h(market)
        return {
            "usd": price * hours,
            "price_per_h": price,
            "market": market,
            "zone": zone,
            "on_demand_usd": self.on_demand_price_per_h * hours,
            "hours": hours,
        }
