"""The aws provider names its prices before the first attempt, from moto's DescribeSpotPriceHistory on
127.0.0.1 (moto's spot price is a fixed 0.00001) and the on-demand prices (config, else the list-price
table), so that the budget check at submission runs on EC2."""

from __future__ import annotations

from pathlib import Path

import pytest

from spotrun.tasks.deadlines.plan import measure, submission_problem
from spotrun.tasks.market.prices import Prices
from spotrun.tasks.providers.aws.prices import ON_DEMAND_LIST_PRICES
from spotrun.trainer.spec.job import JobSpec
from tests.conftest import Ec2World
from tests.integration.test_aws_placement_moto import calls
from tests.integration.test_aws_provider import make_provider

pytestmark = pytest.mark.timeout(60)


def test_prices_are_asked_once_before_any_launch_and_check_the_budget(
    ec2_world: Ec2World, tmp_path: Path
) -> None:
    provider, _ = make_provider(ec2_world)  # on-demand: g5.xlarge 1.2 configured, g6.xlarge from the table
    asked, launched = calls(provider, "DescribeSpotPriceHistory"), calls(provider, "RunInstances")
    prices = provider.prices
    assert prices == Prices(
        spot_per_h=pytest.approx(0.00001), on_demand_per_h=ON_DEMAND_LIST_PRICES["g6.xlarge"]
    )
    assert provider.prices is prices and len(asked) == 1  # asked once, for every type in one call
    assert asked[0]["InstanceTypes"] == ["g5.xlarge", "g6.xlarge"]
    assert launched == []  # nothing launched to learn them

    def check(budget: float) -> tuple[str | None, str | None]:
        job = JobSpec.model_validate(
            {
                "name": "demo",
                "recipe": "digits",
                "total_steps": 1000,
                "storage": str(tmp_path),
                "budget_usd": budget,
                "seconds_per_step": 1,
            }
        )
        return submission_problem(
            job, now=0.0, start=0.0, done_step=0, measured=measure(job, []), prices=prices
        )

    refused, _ = check(1e-6)  # 1,120 s at $0.00001/h is $3.1e-6
    assert refused is not None and "even all on spot" in refused
    problem, warning = check(0.1)  # $0.25 on on-demand
    assert problem is None and warning is not None and "not on on-demand" in warning
    assert check(5.0) == (None, None)


def test_no_spot_price_listed_means_no_prices(ec2_world: Ec2World) -> None:
    """A type EC2 lists no spot price for (nor the table an on-demand one): no budget check, no error."""
    provider, _ = make_provider(ec2_world, instance_types=["x9.huge"])
    assert provider.prices is None
