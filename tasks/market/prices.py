"""What an hour of a worker costs on each market, where a provider knows it (the local trace replay's
settings; EC2 prices are looked up per attempt instead). The deadline checks at submission use it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prices:
    spot_per_h: float
    on_demand_per_h: float
