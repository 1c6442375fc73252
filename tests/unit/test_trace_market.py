"""The local provider's trace replay (tasks/providers/local/market.py) on a fake clock: the tick at a
time, where a spot worker is placed, the capacity error when no zone has any, on-demand always placed,
the reclaim when a zone's capacity drops, the price; and the settings that ask for a replay."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from spotrun.tasks.market.traces import Trace, best_zone
from spotrun.tasks.providers.base import Market, ProvisionError
from spotrun.tasks.providers.local import LocalProviderConfig
from spotrun.tasks.providers.local.market import ON_DEMAND_ZONE, TraceMarket

REPO = Path(__file__).resolve().parents[2]
T0 = 1_000.0  # the fake clock's time at the first placement


def _market(*zones: tuple[str, list[int]], gap_s: float = 60.0, **kw: Any) -> TraceMarket:
    traces = [Trace(zone, gap_s, tuple(caps)) for zone, caps in zones]
    return TraceMarket(traces=traces, spot_price_per_h=0.9, on_demand_price_per_h=3.0, **kw)


@pytest.mark.parametrize(
    ("gap_s", "compress", "start", "elapsed", "tick"),
    [
        (60, 1, 0, 0.0, 0),
        (60, 1, 0, 59.9, 0),
        (60, 1, 0, 60.0, 1),
        (60, 60, 0, 1.0, 1),  # compress 60: a minute of trace per second
        (60, 60, 0, 2.5, 2),
        (195, 390, 0, 1.0, 2),  # a 195 s tick lasts 0.5 s
        (1, 2, 0, 1.6, 3),
        (60, 1, 100, 120.0, 102),  # trace_start_tick
        (60, 1, 5, -3.0, 5),  # a clock behind t0 never goes back before the start
    ],
)
def test_tick_arithmetic(gap_s: float, compress: float, start: int, elapsed: float, tick: int) -> None:
    m = _market(("a", [1]), gap_s=gap_s, compress=compress, start_tick=start)
    assert m.tick(T0) == start  # before the replay began
    m.place("spot", T0)
    assert m.tick(T0 + elapsed) == tick


def test_the_clock_starts_at_the_first_placement_only() -> None:
    m = _market(("a", [1] * 10))
    m.place("on-demand", T0)
    m.place("spot", T0 + 120)
    assert m.t0 == T0 and m.tick(T0 + 120) == 2


@pytest.mark.parametrize(
    ("zones", "tick", "placed"),
    [
        ([("a", [1, 1]), ("b", [1, 1])], 1, "a"),  # ties: name order
        ([("a", [0, 1]), ("b", [1, 1])], 1, "b"),  # b had more over the last day
        ([("a", [1, 0]), ("b", [0, 1])], 1, "b"),  # only b has capacity now
        ([("a", [1, 1, 1, 1]), ("b", [0, 0, 1, 1])], 3, "a"),  # a: 3 of the 3 ticks before, b: 1
        ([("a", [1, 1, 0, 1]), ("b", [0, 0, 1, 1])], 3, "b"),  # a had more, but reclaimed a tick ago
        ([("a", [5, 2]), ("b", [1, 1])], 1, "a"),  # capacity is a count; any > 0 is "has capacity"
    ],
)
def test_spot_goes_to_the_best_zone_with_capacity(
    zones: list[tuple[str, list[int]]], tick: int, placed: str
) -> None:
    m = _market(*zones)
    m.place("on-demand", T0)  # starts the clock
    assert m.place("spot", T0 + tick * 60) == placed


def test_best_zone_is_the_deadline_simulators_rule() -> None:
    traces = [Trace("a", 60, (0, 1, 1)), Trace("b", 60, (1, 1, 1))]
    assert best_zone(traces, 2, [True, True]) == 1 and best_zone(traces, 2, [True, False]) == 0


@pytest.mark.parametrize("start", [0, 3])
def test_no_capacity_anywhere_refuses_spot_as_retryable_and_places_on_demand(start: int) -> None:
    m = _market(("us-x-1a", [1, 1, 1, 0, 0]), ("us-x-1b", [0, 1, 1, 0, 0]), start_tick=start)
    if start == 0:
        assert m.place("spot", T0) == "us-x-1a"
        now = T0 + 3 * 60
    else:
        now = T0
    with pytest.raises(ProvisionError) as e:
        m.place("spot", now)
    assert e.value.retryable
    assert str(e.value) == (
        "no spot capacity in us-x-1a, us-x-1b at trace tick 3; will try again (on-demand is always there)"
    )
    assert m.place("on-demand", now) == ON_DEMAND_ZONE


@pytest.mark.parametrize(
    ("market", "zone", "tick", "reclaimed"),
    [
        ("spot", "a", 0, False),
        ("spot", "a", 1, False),
        ("spot", "a", 2, True),  # a's capacity dropped: the reclaim, at that tick
        ("spot", "a", 3, True),
        ("spot", "b", 2, False),  # b keeps its capacity
        ("spot", "a", 4, False),  # past the end the trace repeats: tick 4 is tick 0
        ("spot", "a", 6, True),  # ... and tick 6 is tick 2
        ("on-demand", ON_DEMAND_ZONE, 2, False),  # never reclaimed
    ],
)
def test_a_drop_in_the_zones_capacity_reclaims_a_spot_worker(
    market: Market, zone: str, tick: int, reclaimed: bool
) -> None:
    m = _market(("a", [1, 1, 0, 0]), ("b", [1, 1, 1, 1]))
    m.place(market, T0)
    assert m.reclaimed_at(market, zone, T0 + tick * 60) == (tick if reclaimed else None)


@pytest.mark.parametrize(
    ("market", "price", "usd"),
    [("spot", 0.9, 0.9 * 1.5), ("on-demand", 3.0, 3.0 * 1.5)],
)
def test_an_attempt_costs_its_markets_price_times_its_wall_hours(
    market: Market, price: float, usd: float
) -> None:
    m = _market(("a", [1]))
    cost = m.cost(market, "a", started_at=T0, ended_at=T0 + 5400)
    assert cost == {
        "usd": pytest.approx(usd),
        "price_per_h": price,
        "market": market,
        "zone": "a",
        "on_demand_usd": pytest.approx(4.5),
        "hours": 1.5,
    }


# -- settings ---------------------------------------------------------------------------------


def _trace_file(path: Path, caps: list[int], gap: float = 1.0) -> Path:
    path.write_text(json.dumps({"metadata": {"gap_seconds": gap}, "data": caps}))
    return path


REGION = str(REPO / "tests" / "data" / "spot-traces" / "us-east-2")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"trace": "/nonexistent/trace.json"}, "spot trace /nonexistent/trace.json: cannot read it"),
        ({"trace": REGION, "zones": ["us-east-2z"]}, "has no zone us-east-2z; it has us-east-2a, us-east-2b"),
        ({"zones": ["us-east-2a"]}, "zones picks zones of a trace: set trace too"),
        ({"trace": REGION, "simulator": {"mean_interval_s": 60}}, "set trace or a simulator schedule"),
        ({"trace": REGION, "simulator": {"schedule": [{"after_s": 1}]}}, "set trace or a simulator schedule"),
        ({"trace": REGION, "compress": 0}, "greater than 0"),
        ({"trace": REGION, "spot_price_per_h": -1}, "greater than or equal to 0"),
    ],
)
def test_settings_refuse_a_bad_trace_in_one_line(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        LocalProviderConfig.model_validate(settings)


def test_settings_build_the_replay(tmp_path: Path) -> None:
    assert TraceMarket.of(LocalProviderConfig()) is None
    cfg = LocalProviderConfig(trace=REGION, zones=["us-east-2b"], compress=390, trace_start_tick=7)
    m = TraceMarket.of(cfg)
    assert m is not None and m.zones == ["us-east-2b"] and (m.compress, m.start_tick) == (390, 7)
    assert (m.spot_price_per_h, m.on_demand_price_per_h) == (0.918, 3.06)  # p3.2xlarge, us-east-1
    one = TraceMarket.of(LocalProviderConfig(trace=str(_trace_file(tmp_path / "z-1a_v100_1.json", [0, 1]))))
    assert one is not None and one.zones == ["z-1a"]


def test_the_docs_example_is_valid_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/architecture.md's trace replay example parses, and its trace is the slice in tests/data."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    block = doc.split("**Trace replay.**", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(REPO)  # the example's trace path is relative to the repository
    cfg = LocalProviderConfig.model_validate(yaml.safe_load(block)["provider"])
    m = TraceMarket.of(cfg)
    assert m is not None and m.zones == ["us-east-2a", "us-east-2b"] and m.traces[0].gap_s / m.compress == 0.5
