"""Table tests of several regions on the aws provider: the settings (a one-region config validates as
before; `regions` is an opt-in with its own subnets and image), the ranking across regions by the job's
history and the spot placement scores, and the controller's IAM policy per region."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from spotrun.tasks.providers.aws.config import AwsProviderConfig
from spotrun.tasks.providers.aws.iam import Scope, controller_policy
from spotrun.tasks.providers.aws.policy import Placement, PlacementEvent, PlacementOutcome, rank_placements

A1, A2, B1 = "subnet-000000a1", "subnet-000000a2", "subnet-000000b1"
AZS = {A1: "ca-central-1a", A2: "ca-central-1b", B1: "us-east-1b"}
REGION_OF = {A1: None, A2: None, B1: "us-east-1"}
P, CAP = PlacementOutcome.PREEMPTED, PlacementOutcome.CAPACITY
OTHER: dict[str, Any] = {"region": "us-east-1", "subnets": [B1], "image_id": "ami-0000000000000000b"}


def cfg(**over: Any) -> AwsProviderConfig:
    base: dict[str, Any] = {
        "region": "ca-central-1",
        "instance_types": ["g5.xlarge"],
        "subnets": [A1, A2],
        "image_id": "ami-0000000000000000a",
        "regions": [OTHER],
    }
    return AwsProviderConfig.model_validate({**base, **over})


def ev(subnet: str, outcome: PlacementOutcome, t: float, itype: str = "g5.xlarge") -> PlacementEvent:
    return PlacementEvent(Placement(subnet, AZS[subnet], itype, region=REGION_OF[subnet]), outcome, t)


# (history, scores, the subnets in rank order) with region ca-central-1 (a1, a2) and regions [us-east-1 (b1)]
RANKS: list[tuple[list[PlacementEvent], dict[str, int], list[str]]] = [
    ([], {}, [A1, A2, B1]),  # the configured order
    ([ev(A1, CAP, 1)], {}, [B1, A2, A1]),  # a1 refused: the unhit region before a1's sister zone
    ([ev(A1, CAP, 1), ev(B1, P, 2)], {}, [A2, A1, B1]),  # both hit: the region hit longest ago
    ([], {"us-east-1b": 9, "ca-central-1a": 3}, [B1, A1, A2]),  # scores compare across regions
    ([ev(B1, P, 1)], {"us-east-1b": 9}, [A1, A2, B1]),  # the history ranks above the score
]


@pytest.mark.parametrize(("history", "scores", "order"), RANKS)
def test_regions_are_ranked_by_the_jobs_history_then_the_scores(
    history: list[PlacementEvent], scores: dict[str, int], order: list[str]
) -> None:
    ranked = rank_placements(cfg(), history, AZS, "spot", scores=scores)
    assert [p.subnet for p in ranked] == order
    assert all(p.region == REGION_OF[p.subnet or ""] for p in ranked)


def test_a_one_region_config_is_unchanged() -> None:
    one = cfg(regions=[])
    assert one.regions == [] and one.region_names() == ["ca-central-1"] and one.site(None) is one
    assert [p.region for p in rank_placements(one, [], AZS, "spot")] == [None, None]


def test_a_region_is_seen_through_its_own_subnets_image_and_groups() -> None:
    site = cfg(security_groups=["sg-0a"], kms_key_id="alias/a").site("us-east-1")
    assert (site.region, site.subnets, site.image_id, site.security_groups) == (
        "us-east-1",
        [B1],
        OTHER["image_id"],
        [],
    )
    assert site.kms_key_id is None and site.regions == [] and site.instance_types == ["g5.xlarge"]


@pytest.mark.parametrize(
    ("over", "says"),
    [
        ({"regions": [OTHER, OTHER]}, "listed twice"),
        ({"regions": [{**OTHER, "region": "ca-central-1"}]}, "listed twice"),
        ({"regions": [{**OTHER, "image_id": None}]}, "regions[us-east-1]: set image_id"),
        ({"regions": [{**OTHER, "region": "us-east-1b"}]}, "not a region name"),
        ({"allocation": "fleet"}, "an EC2 Fleet is per region"),
        ({"placement_group": True}, "placement_group is not built for several regions"),
    ],
)
def test_bad_regions_are_refused_with_the_fix(over: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError, match=says.replace("[", r"\[").replace("]", r"\]")):
        cfg(**over)


def test_the_controller_policy_names_each_region() -> None:
    scope = Scope(account="123456789012", installation="inst-1", storage="s3://bucket/jobs")
    doc = controller_policy(cfg(kms_key_id="alias/ebs"), scope)
    sids = [s["Sid"] for s in doc["Statement"]]
    assert len(sids) == len(set(sids))  # one Sid per statement, in every region
    launch = {s["Sid"]: s for s in doc["Statement"] if s["Sid"].startswith("LaunchFromThese")}
    assert set(launch) == {"LaunchFromTheseCaCentral1", "LaunchFromTheseUsEast1"}
    there = launch["LaunchFromTheseUsEast1"]
    assert there["Condition"]["StringEquals"]["aws:RequestedRegion"] == "us-east-1"
    assert f"arn:aws:ec2:us-east-1:123456789012:subnet/{B1}" in there["Resource"]
    assert "arn:aws:ec2:us-east-1::image/ami-0000000000000000b" in there["Resource"]
    ebs = [s for s in doc["Statement"] if s["Sid"].startswith("EncryptedRootVolumes")]
    assert [s["Sid"] for s in ebs] == ["EncryptedRootVolumesCaCentral1"]  # us-east-1 names no key
    one = controller_policy(cfg(regions=[]), scope)  # one region: the Sids as before
    assert "LaunchFromThese" in [s["Sid"] for s in one["Statement"]]
