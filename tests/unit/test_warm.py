"""Warm workers' pure decisions (tasks/control/warm.py) and settings, with tables; the standby armed once,
at the attempt's `started`, with the wait its idle limit asks for."""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from spotrun.tasks.control.prewarm import PREWARM_WAIT_S, Prewarm
from spotrun.tasks.control.warm import (
    FROM_POOL,
    NO_IDLE_LIMIT_S,
    WARM,
    WARM_REASON,
    WarmStandby,
    from_pool,
    standby_s,
    standby_usd,
    warm_of,
)
from spotrun.tasks.market.prices import Prices
from spotrun.tasks.providers.aws.config import AwsProviderConfig
from spotrun.tasks.providers.base import WarmSettings, Worker
from spotrun.tasks.providers.local import LocalProvider, LocalProviderConfig
from spotrun.trainer.telemetry.records import Started


@pytest.mark.parametrize(
    ("armed_at", "ended_at", "idle_s", "expected"),
    [
        (100.0, 160.0, None, 60.0),  # stood by the whole attempt
        (100.0, 160.0, 30.0, 30.0),  # ended by its idle limit
        (100.0, 120.0, 30.0, 20.0),  # the attempt ended first
        (100.0, 90.0, None, 0.0),  # a clock step back: never negative
    ],
)
def test_standby_seconds(armed_at: float, ended_at: float, idle_s: float | None, expected: float) -> None:
    assert standby_s(armed_at, ended_at, idle_s) == expected


@pytest.mark.parametrize(
    ("seconds", "prices", "expected"),
    [(3600.0, Prices(0.9, 3.0), 0.9), (1800.0, Prices(0.9, 3.0), 0.45), (60.0, None, None)],
)
def test_standby_cost_at_the_spot_price(
    seconds: float, prices: Prices | None, expected: float | None
) -> None:
    assert standby_usd(seconds, prices) == expected


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        (LocalProviderConfig(), None),
        (LocalProviderConfig(warm=1), WarmSettings(1, None)),
        (LocalProviderConfig(warm=1, warm_idle_s=600), WarmSettings(1, 600.0)),
    ],
)
def test_the_local_provider_offers_what_its_settings_ask(
    cfg: LocalProviderConfig, expected: WarmSettings | None
) -> None:
    assert warm_of(LocalProvider(cfg)) == expected


# the fields each kind needs besides the warm ones
LOCAL: dict[str, object] = {}
AWS: dict[str, object] = {
    "region": "us-east-1",
    "instance_types": ["g5.xlarge"],
    "image_id": "ami-0123456789a",
}
KINDS = [(LocalProviderConfig, LOCAL), (AwsProviderConfig, AWS)]
Kind = type[LocalProviderConfig | AwsProviderConfig]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, WarmSettings(0, None)),
        ({"warm": 1}, WarmSettings(1, None)),
        ({"warm": 1, "warm_idle_s": 600}, WarmSettings(1, 600.0)),
        ({"warm": 0, "prewarm": False}, WarmSettings(0, None)),
    ],
)
@pytest.mark.parametrize(("model", "base"), KINDS)
def test_settings_accepted(
    model: Kind, base: dict[str, object], fields: dict[str, object], expected: WarmSettings
) -> None:
    cfg = model.model_validate({**base, **fields})
    assert WarmSettings(cfg.warm, cfg.warm_idle_s) == expected


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"warm": 2}, "less than or equal to 1"),
        ({"warm": -1}, "greater than or equal to 0"),
        ({"warm": 1, "prewarm": False}, "set prewarm: true, or warm: 0 "),
        ({"warm": 1, "warm_idle_s": 0}, "greater than 0"),
    ],
)
@pytest.mark.parametrize(("model", "base"), KINDS)
def test_settings_refused(
    model: Kind, base: dict[str, object], fields: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message) as e:
        model.model_validate({**base, **fields})
    assert e.value.error_count() == 1  # one line naming the fix


def started() -> Started:
    return Started(t=time.time(), step=0, resumed_from=None, checkpoint=None)


@pytest.mark.parametrize(
    ("idle_s", "wait"), [(None, f"{NO_IDLE_LIMIT_S:g}"), (60.0, f"{60 + PREWARM_WAIT_S:g}")]
)
def test_armed_once_at_started_and_costed(idle_s: float | None, wait: str) -> None:
    calls: list[list[str]] = []

    def provision(extra: list[str]) -> Worker:
        calls.append(extra)
        return Worker("standby", "fake", 2, time.time())

    ahead = Prewarm(provision, lambda w: None)
    seen: list[Started] = []
    standby = WarmStandby(WarmSettings(1, idle_s), ahead, lambda: ["--x"])
    on_started = standby.started(seen.append)
    assert standby.extra(time.time(), None) == {}  # not armed: no standby, no cost
    on_started(started())
    on_started(started())  # a second record: nothing more
    worker = ahead.take()
    assert worker is not None and len(seen) == 2
    assert calls == [["--x", "--prewarm-wait", wait]]
    assert standby.armed_at is not None
    extra = standby.extra(standby.armed_at + 7200, Prices(1.0, 3.0))
    expected_s = 7200.0 if idle_s is None else idle_s
    assert extra == {WARM: {"standby_s": expected_s, "usd": round(expected_s / 3600, 6), "idle_s": idle_s}}
    assert from_pool(ahead, ahead.started_at or 0)[FROM_POOL]["stood_by_s"] == 0
    assert ahead.reason == WARM_REASON


def test_a_notice_first_leaves_its_prewarm_alone() -> None:
    ahead = Prewarm(lambda extra: Worker("r", "fake", 2, time.time()))
    ahead.start(list)  # the notice's replacement
    standby = WarmStandby(WarmSettings(1, None), ahead, list)
    standby.started(None)(started())
    assert standby.armed_at is None and standby.extra(time.time(), None) == {}
    assert from_pool(ahead, time.time()) == {}  # a notice's replacement is no warm standby
    ahead.take()
