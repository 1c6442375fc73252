"""Placement across zones on the aws provider against moto's EC2 on 127.0.0.1: a GetSpotPlacementScores
that the endpoint refuses (moto does not serve it) is one warning and the configured order; the scores
it would give (the recorded response's shape, taken from the API reference) order the zones; a fleet
with capacity-optimized-prioritized is accepted with each type's priority; a rebalance recommendation
marks the worker's pool, so that the replacement started at it lands in another zone."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from spotrun.tasks.providers.aws import AwsProvider
from spotrun.tasks.providers.aws.policy import PlacementOutcome
from spotrun.trainer.spec.job import JobSpec
from tests.conftest import Ec2World
from tests.integration.test_aws_provider import beat, instance, job, make_provider, rec, watch

pytestmark = pytest.mark.timeout(60)
__all__ = ["job"]  # the fixture, shared with test_aws_provider.py

RECORDED = Path(__file__).resolve().parents[1] / "data" / "aws" / "spot_placement_scores.json"


def calls(provider: AwsProvider, action: str) -> list[dict[str, Any]]:
    """The parameters of each `action` request the provider's client sends (botocore's own event hook)."""
    seen: list[dict[str, Any]] = []
    provider.ec2.meta.events.register(
        f"provide-client-params.ec2.{action}", lambda params, **_: seen.append(params)
    )
    return seen


def test_a_refused_score_call_warns_once_and_keeps_the_configured_order(
    ec2_world: Ec2World, job: tuple[JobSpec, Path], caplog: pytest.LogCaptureFixture
) -> None:
    provider, _ = make_provider(ec2_world, placement_scores_ttl_s=0)  # ask at every provisioning
    asked = calls(provider, "GetSpotPlacementScores")
    with caplog.at_level(logging.DEBUG, logger="spotrun.tasks.providers.aws.sites"):
        for attempt in (1, 2):
            worker = provider.provision(job[0], attempt, job[1], [])
            provider.release(worker)
            assert worker.handle.placement.subnet == ec2_world.subnets[0]  # the configured order
    assert [p["TargetCapacity"] for p in asked] == [1, 1] and asked[0]["SingleAvailabilityZone"] is True
    assert asked[0]["InstanceTypes"] == ["g5.xlarge", "g6.xlarge"]
    refusals = [r for r in caplog.records if "GetSpotPlacementScores" in r.getMessage()]
    assert [r.levelname for r in refusals] == ["WARNING", "DEBUG"]  # one warning, not an error
    assert "does not serve GetSpotPlacementScores" in refusals[0].getMessage()


class _Answer:
    status_code = 200
    headers: dict[str, str] = {}


def test_scores_order_the_zones_and_are_asked_once_per_ttl(
    ec2_world: Ec2World, job: tuple[JobSpec, Path]
) -> None:
    """moto lacks the action: the one request is answered with rows shaped as the recorded response
    (taken from the API reference), scoring moto's zones, the last subnet's best."""
    ids = {
        s["SubnetId"]: s["AvailabilityZoneId"]
        for s in ec2_world.ec2.describe_subnets(SubnetIds=ec2_world.subnets)["Subnets"]
    }
    rows = json.loads(RECORDED.read_text())["SpotPlacementScores"]
    answer = {
        "SpotPlacementScores": [
            {**row, "Region": ec2_world.region, "AvailabilityZoneId": ids[subnet]}
            for row, subnet in zip(rows, reversed(ec2_world.subnets), strict=False)
        ]
    }
    provider, _ = make_provider(ec2_world)
    asked = calls(provider, "GetSpotPlacementScores")
    provider.ec2.meta.events.register(
        "before-call.ec2.GetSpotPlacementScores", lambda **_: (_Answer(), answer)
    )
    first = provider.provision(job[0], 1, job[1], [])
    provider.release(first)
    second = provider.provision(job[0], 2, job[1], [])
    provider.release(second)
    assert first.handle.placement.subnet == ec2_world.subnets[2]  # the best score
    assert second.handle.placement.subnet == ec2_world.subnets[2]  # it ended well: the same zone again
    assert len(asked) == 1  # cached for placement_scores_ttl_s


def test_capacity_optimized_prioritized_fleet_is_accepted_with_type_priorities(
    ec2_world: Ec2World, job: tuple[JobSpec, Path]
) -> None:
    provider, _ = make_provider(
        ec2_world,
        allocation="fleet",
        spot_allocation_strategy="capacity-optimized-prioritized",
        placement_scores=False,
    )
    sent = calls(provider, "CreateFleet")
    worker = provider.provision(job[0], 1, job[1], [])
    try:
        assert instance(ec2_world, worker.id)["InstanceLifecycle"] == "spot"
        fleet = ec2_world.ec2.describe_fleets(FleetIds=[worker.handle.fleet_id])["Fleets"][0]
    finally:
        provider.release(worker)
    assert fleet["SpotOptions"]["AllocationStrategy"] == "capacity-optimized-prioritized"
    overrides = sent[0]["LaunchTemplateConfigs"][0]["Overrides"]
    assert len(overrides) == 6  # 3 zones x 2 types, each type's priority its place in instance_types
    stored = {(o["InstanceType"], o.get("Priority")) for o in fleet["LaunchTemplateConfigs"][0]["Overrides"]}
    assert stored == {("g5.xlarge", 0.0), ("g6.xlarge", 1.0)}  # as EC2 (moto) keeps the request


def test_a_rebalance_recommendation_marks_the_pool_and_the_replacement_goes_elsewhere(
    ec2_world: Ec2World, job: tuple[JobSpec, Path]
) -> None:
    provider, _ = make_provider(ec2_world, placement_scores=False)
    first = provider.provision(job[0], 1, job[1], [])
    notice = rec("notice", cloud="aws", action="rebalance recommendation", stop=False, deadline=None)
    exit_ = rec("exit", code=0, name="COMPLETED", step=50)
    beat(job[0], first, rec("started", step=0), notice, rec("step", step=50), exit_)
    result, seen = watch(provider, first)
    assert any(getattr(r, "kind", "") == "notice" for r in seen) and result.exit_code == 0
    marks = [(e.placement.subnet, e.outcome) for e in provider.history]
    assert (ec2_world.subnets[0], PlacementOutcome.REBALANCE) in marks
    second = provider.provision(job[0], 2, job[1], [])
    provider.release(second)
    assert second.handle.placement.az != first.handle.placement.az
