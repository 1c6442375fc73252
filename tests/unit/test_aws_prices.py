"""The prices the budget check reads on EC2 (tasks/providers/aws/prices.py): the newest spot price per
(type, zone), the cheapest over the job's zones; on-demand from the config, else the list-price table."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from spotrun.tasks.market.prices import Prices
from spotrun.tasks.providers.aws.config import AwsProviderConfig
from spotrun.tasks.providers.aws.prices import ON_DEMAND_LIST_PRICES, cheapest, newest_spot, on_demand_price


def row(itype: str, az: str, price: str, hour: int) -> dict[str, Any]:
    return {
        "InstanceType": itype,
        "AvailabilityZone": az,
        "SpotPrice": price,
        "Timestamp": datetime(2026, 12, 1, hour, tzinfo=UTC),
    }


ROWS = [
    row("g5.xlarge", "ca-central-1a", "0.50", 1),
    row("g5.xlarge", "ca-central-1a", "0.40", 3),  # newer: this one counts
    row("g5.xlarge", "ca-central-1b", "0.30", 2),
    row("g6.xlarge", "ca-central-1b", "0.35", 2),
    row("g6.xlarge", "ca-central-1d", "0.20", 2),  # a zone the job has no subnet in
]

# (zones, newest per (type, zone))
NEWEST: list[tuple[set[str] | None, dict[tuple[str, str], float]]] = [
    (
        None,
        {
            ("g5.xlarge", "ca-central-1a"): 0.40,
            ("g5.xlarge", "ca-central-1b"): 0.30,
            ("g6.xlarge", "ca-central-1b"): 0.35,
            ("g6.xlarge", "ca-central-1d"): 0.20,
        },
    ),
    ({"ca-central-1a"}, {("g5.xlarge", "ca-central-1a"): 0.40}),
    (set(), {}),
]


@pytest.mark.parametrize(("zones", "expected"), NEWEST)
def test_the_newest_price_of_each_pool_in_the_jobs_zones(
    zones: set[str] | None, expected: dict[tuple[str, str], float]
) -> None:
    assert newest_spot(ROWS, zones) == expected


# (spot per pool, on-demand per type, prices)
CHEAPEST: list[tuple[dict[tuple[str, str], float], list[float | None], Prices | None]] = [
    ({("g5.xlarge", "a"): 0.4, ("g6.xlarge", "b"): 0.35}, [1.006, 0.8048], Prices(0.35, 0.8048)),
    ({("g5.xlarge", "a"): 0.4}, [None, 1.2], Prices(0.4, 1.2)),
    ({}, [1.0], None),  # no spot history: the check waits
    ({("g5.xlarge", "a"): 0.4}, [None], None),  # no on-demand price
]


@pytest.mark.parametrize(("spot", "on_demand", "expected"), CHEAPEST)
def test_the_cheapest_hour_on_each_market(
    spot: dict[tuple[str, str], float], on_demand: list[float | None], expected: Prices | None
) -> None:
    assert cheapest(spot, on_demand) == expected


def test_on_demand_from_the_config_else_the_list_price_table() -> None:
    cfg = AwsProviderConfig.model_validate(
        {
            "region": "ca-central-1",
            "instance_types": ["g5.xlarge", "g6.xlarge", "x9.huge"],
            "image_id": "ami-0123",
            "on_demand_price_per_h": {"g5.xlarge": 1.12},
        }
    )
    assert on_demand_price(cfg, "g5.xlarge") == 1.12  # the config's wins
    assert on_demand_price(cfg, "g6.xlarge") == ON_DEMAND_LIST_PRICES["g6.xlarge"]
    assert on_demand_price(cfg, "x9.huge") is None
