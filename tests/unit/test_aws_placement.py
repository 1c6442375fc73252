"""Table tests of placement across zones: EC2's spot placement scores under the job's own history, the
fleet's allocation strategy and type priorities, what a refused score call says, a rebalance
recommendation's mark, and the trace replay's rule that a zone that just reclaimed ranks last."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError
from botocore.parsers import ResponseParserError
from pydantic import ValidationError

from spotrun.tasks.market.traces import Trace, best_zone, reclaimed_within
from spotrun.tasks.providers.aws import launch
from spotrun.tasks.providers.aws.config import AwsProviderConfig
from spotrun.tasks.providers.aws.errors import scores_refusal
from spotrun.tasks.providers.aws.policy import (
    Placement,
    PlacementEvent,
    PlacementOutcome,
    apart_from,
    choose_market,
    next_placement,
    rank_placements,
    zone_scores,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "aws"
A, B, C = "subnet-0000000a", "subnet-0000000b", "subnet-0000000c"
AZS = {A: "us-east-1a", B: "us-east-1b", C: "us-east-1c"}
ZONE_NAMES = {"use1-az6": "us-east-1a", "use1-az4": "us-east-1b", "use1-az1": "us-east-1c"}
P, CAP, REB = PlacementOutcome.PREEMPTED, PlacementOutcome.CAPACITY, PlacementOutcome.REBALANCE


def cfg(**over: Any) -> AwsProviderConfig:
    base: dict[str, Any] = {
        "region": "us-east-1",
        "instance_types": ["g5.xlarge", "g6.xlarge"],
        "subnets": [A, B, C],
        "image_id": "ami-0123456789abcdef0",
    }
    return AwsProviderConfig.model_validate({**base, **over})


def ev(subnet: str, itype: str, outcome: PlacementOutcome, t: float) -> PlacementEvent:
    return PlacementEvent(Placement(subnet, AZS[subnet], itype), outcome, t)


def test_the_recorded_response_maps_zone_ids_to_this_accounts_names() -> None:
    """tests/data/aws/spot_placement_scores.json is taken from the API reference, not a live account."""
    doc = json.loads((DATA / "spot_placement_scores.json").read_text())
    assert "not recorded from a live account" in doc["_source"].lower()
    # use1-az2 is no configured subnet's zone: dropped
    assert zone_scores(doc, ZONE_NAMES) == {"us-east-1b": 9, "us-east-1a": 7, "us-east-1c": 3}


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        ([], {}),
        (
            [{"AvailabilityZoneId": "use1-az6", "Score": 4}, {"AvailabilityZoneId": "use1-az6", "Score": 8}],
            {"us-east-1a": 8},
        ),
        ([{"AvailabilityZoneId": "use1-az6"}, {"AvailabilityZoneId": "use1-az4", "Score": "9"}], {}),
        ([{"Region": "us-east-1", "Score": 5}], {}),  # a region's score (no zone): not ours
    ],
)
def test_zone_scores_of_odd_answers(rows: list[dict[str, Any]], expected: dict[str, int]) -> None:
    assert zone_scores({"SpotPlacementScores": rows}, ZONE_NAMES) == expected


SCORES = {"us-east-1a": 3, "us-east-1b": 9, "us-east-1c": 6}


@pytest.mark.parametrize(
    ("history", "scores", "expected"),
    [
        ([], {}, (A, "g5.xlarge")),  # no scores: the configured order
        ([], SCORES, (B, "g5.xlarge")),  # scores order the zones of the preferred type
        ([ev(B, "g5.xlarge", P, 10.0)], SCORES, (C, "g6.xlarge")),  # history first: b hit, g5 hit
        ([ev(B, "g6.xlarge", P, 10.0)], SCORES, (C, "g5.xlarge")),  # b avoided; c scores above a
        ([ev(B, "g5.xlarge", CAP, 10.0)], SCORES, (C, "g6.xlarge")),
        # every zone hit: the one hit longest ago, whatever its score
        (
            [ev(A, "g5.xlarge", P, 1.0), ev(B, "g6.xlarge", P, 2.0), ev(C, "g5.xlarge", CAP, 3.0)],
            SCORES,
            (A, "g6.xlarge"),
        ),
        ([ev(B, "g5.xlarge", REB, 10.0)], SCORES, (C, "g6.xlarge")),  # a rebalance marks like a reclaim
        ([], {"us-east-1c": 2}, (C, "g5.xlarge")),  # a zone without a score ranks below one with
    ],
)
def test_scores_break_the_ties_the_history_leaves(
    history: list[PlacementEvent], scores: dict[str, int], expected: tuple[str, str]
) -> None:
    p = next_placement(cfg(), history, AZS, now=100.0, scores=scores)
    assert (p.subnet, p.instance_type) == expected


def test_on_demand_ignores_spot_scores_and_a_rebalance_is_no_preemption() -> None:
    od = rank_placements(cfg(), [], AZS, "on-demand", scores=SCORES)
    assert [p.subnet for p in od[:3]] == [A, B, C]
    rebalanced = [ev(A, "g5.xlarge", REB, 1.0), ev(B, "g5.xlarge", REB, 2.0)]
    assert choose_market(cfg(on_demand_after_preemptions=1), rebalanced, 3.0) == "spot"
    assert choose_market(cfg(on_demand_after_preemptions=1), [ev(A, "g5.xlarge", P, 1.0)], 3.0) == "on-demand"


@pytest.mark.parametrize(
    ("strategy", "market", "allocation", "priorities"),
    [
        ("price-capacity-optimized", "spot", "price-capacity-optimized", [None] * 6),
        ("capacity-optimized", "spot", "capacity-optimized", [None] * 6),
        # each override's Priority is its type's place in instance_types, whatever the ranking
        (
            "capacity-optimized-prioritized",
            "spot",
            "capacity-optimized-prioritized",
            [1.0, 1.0, 0.0, 0.0, 1.0, 0.0],  # pools ranked g6/b g6/c g5/b g5/c g6/a g5/a
        ),
        ("capacity-optimized-prioritized", "on-demand", None, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]),  # the ranking
    ],
)
def test_fleet_allocation_strategy_and_priorities(
    strategy: str, market: str, allocation: str | None, priorities: list[float | None]
) -> None:
    c = cfg(allocation="fleet", spot_allocation_strategy=strategy)
    pools = rank_placements(c, [ev(A, "g5.xlarge", P, 1.0)], AZS, market)  # type: ignore[arg-type]
    f = launch.fleet_params(c, "lt-1", pools, tags={}, market=market)  # type: ignore[arg-type]
    assert f.get("SpotOptions", {}).get("AllocationStrategy") == allocation
    assert [o.get("Priority") for o in f["LaunchTemplateConfigs"][0]["Overrides"]] == priorities


def test_a_strategy_without_a_fleet_is_refused() -> None:
    with pytest.raises(ValidationError, match="set allocation: fleet"):
        cfg(spot_allocation_strategy="capacity-optimized-prioritized")
    with pytest.raises(ValidationError, match="greater than 180"):
        cfg(rebalance_prewarm_s=120)


def _client_error(code: str, status: int = 400) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "GetSpotPlacementScores",
    )


@pytest.mark.parametrize(
    ("error", "says"),
    [
        (_client_error("UnauthorizedOperation"), "allow ec2:GetSpotPlacementScores"),
        (_client_error("RequestLimitExceeded"), "unavailable in us-east-1 (RequestLimitExceeded)"),
        (_client_error("InternalError", 500), "this time"),
        (ResponseParserError("<!doctype html>"), "does not serve GetSpotPlacementScores"),
        (_client_error("InvalidParameterValue"), "not available in us-east-1 (InvalidParameterValue"),
    ],
)
def test_a_refused_score_call_is_one_line_and_the_configured_order(error: Exception, says: str) -> None:
    line = scores_refusal(error, "us-east-1")
    assert says in line and line.endswith(("configured order", "configured order this time"))
    assert "\n" not in line


# -- the trace replay: a zone that just reclaimed ranks last ------------------------------------------


@pytest.mark.parametrize(
    ("caps", "tick", "ticks", "reclaimed"),
    [
        ((1, 1, 1, 1), 3, 2, False),
        ((1, 0, 1, 1), 3, 2, False),  # the drop at tick 1 is older than 2 ticks
        ((1, 0, 1, 1), 3, 3, True),
        ((0, 0, 1, 1), 3, 4, False),  # came up, never went down: nothing reclaimed
        ((1, 1, 0, 1), 3, 2, True),
        ((1, 1, 1, 0), 3, 1, True),  # dropping now
    ],
)
def test_reclaimed_within(caps: tuple[int, ...], tick: int, ticks: int, reclaimed: bool) -> None:
    assert reclaimed_within(Trace("z", 60, caps), tick, ticks) is reclaimed


@pytest.mark.parametrize(
    ("a", "b", "tick", "best"),
    [
        # a had more capacity over the day, but dropped 10 minutes ago: b
        ((1,) * 100 + (0,) + (1,) * 10, (0,) * 50 + (1,) * 61, 110, "b"),
        # a's drop was two hours ago (120 ticks of 60 s): the day's tally again
        ((1,) * 100 + (0,) + (1,) * 120, (0,) * 50 + (1,) * 171, 220, "a"),
        # both dropped within the hour: the day's tally
        ((1,) * 100 + (0,) + (1,) * 10, (1,) * 100 + (0,) * 5 + (1,) * 6, 110, "a"),
    ],
)
def test_the_trace_replay_places_away_from_a_zone_that_just_reclaimed(
    a: tuple[int, ...], b: tuple[int, ...], tick: int, best: str
) -> None:
    traces = [Trace("a", 60, a), Trace("b", 60, b)]
    assert traces[best_zone(traces, tick, [True, True])].zone == best


def pool(subnet: str | None) -> Placement:
    return Placement(subnet, AZS[subnet] if subnet else None, "g5.xlarge")


@pytest.mark.parametrize(
    ("ranked", "busy", "expected"),
    [
        ([A, B, C], set(), [A, B, C]),  # nothing runs: the ranking as it is
        ([A, B, C], {"us-east-1a"}, [B, C, A]),  # the running worker's zone last, the rest in rank order
        ([C, A, B], {"us-east-1a", "us-east-1c"}, [B, C, A]),  # two live workers
        ([A], {"us-east-1a"}, [A]),  # one zone configured: it is used (provider.py warns once)
        ([None], {"us-east-1a"}, [None]),  # the default VPC picks: its zone is unknown here
    ],
)
def test_a_standby_goes_apart_from_the_running_workers_zone(
    ranked: list[str | None], busy: set[str], expected: list[str | None]
) -> None:
    assert apart_from([pool(s) for s in ranked], busy) == [pool(s) for s in expected]
