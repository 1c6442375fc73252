"""Interruption notices: the emergency-save decision, each cloud's payloads, the spec's options, the
watchers against local stand-ins of the metadata services, and the storage heartbeat."""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from spotrun.trainer.checkpoint.catalog import list_checkpoints
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.preemption.notices import (
    AWS_INSTANCE_ACTION,
    AWS_TOKEN,
    AWS_TTL_HEADER,
    AwsWatcher,
    AzureWatcher,
    GcpWatcher,
    MetadataError,
    Notice,
    make_watcher,
    parse_aws_instance_action,
    parse_aws_rebalance,
    parse_azure_events,
    parse_gcp_preempted,
)
from spotrun.trainer.preemption.requests import StopRequest, plan_emergency_save
from spotrun.trainer.saving.checkpointer import Checkpointer, SaveTimings
from spotrun.trainer.spec.job import SHAPE_FIELDS, PreemptionOptions, parse_spec
from spotrun.trainer.storage import LocalStorage, put_bytes
from spotrun.trainer.telemetry.heartbeat import (
    HeartbeatWriter,
    heartbeat_key,
    heartbeat_losses,
    heartbeat_records,
    read_heartbeat,
)
from spotrun.trainer.telemetry.records import Durable, Exit, Started, Step
from tests.fakes.imds import FakeAzureEvents, FakeGCPMetadata, FakeIMDS, unused_endpoint

MB = 1_000_000
NOW = 1_800_000_000.0
BASE = {"name": "j", "recipe": "digits", "total_steps": 10}


def wait_until(cond: Callable[[], bool], timeout: float = 3.0) -> bool:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


# ---------------------------------------------------------------- the decision


# state MB, write MB/s, upload MB/s, seconds left, margin, measured, in flight -> save, estimate, reason has
PLANS = [
    ("small state, 2 min", 100, 1000, 100, 120, 5, True, False, True, 1.1, "needs ~1.1 s (100.0 MB at 90.9"),
    ("120 MB at 8.5 MB/s, 6 s", 120, 17, 17, 6, 5, True, False, False, 14.118, "6.0 s left, margin 5 s"),
    ("fits only without margin", 100, 20, 20, 12, 5, True, False, False, 10.0, "needs ~10.0 s"),
    ("exactly the margin", 100, 20, 20, 15, 5, True, False, True, 10.0, "15.0 s left"),
    ("a save in flight doubles", 100, 20, 20, 15, 5, True, True, False, 20.0, "+ the checkpoint in flight"),
    ("deadline passed", 1, 1000, 1000, -2, 5, True, False, False, 0.002, "-2.0 s left"),
    ("nothing measured yet", 50, 25, 25, 30, 5, False, False, True, 4.0, "default bandwidth"),
    ("zero margin", 10, 10, 10, 2, 0, True, False, True, 2.0, "needs ~2.0 s"),
]


@pytest.mark.parametrize(
    ("label", "mb", "w", "u", "left", "margin", "measured", "in_flight", "save", "est", "needle"), PLANS
)
def test_plan_emergency_save(
    label: str,
    mb: float,
    w: float,
    u: float,
    left: float,
    margin: float,
    measured: bool,
    in_flight: bool,
    save: bool,
    est: float,
    needle: str,
) -> None:
    plan = plan_emergency_save(
        int(mb * MB),
        w * MB,
        u * MB,
        now=NOW,
        deadline=NOW + left,
        margin_s=margin,
        measured=measured,
        in_flight=in_flight,
    )
    assert (plan.save, round(plan.estimate_s, 3)) == (save, est), label
    assert needle in plan.reason, plan.reason


def test_plan_rejects_zero_bandwidth() -> None:
    with pytest.raises(ValueError, match="positive"):
        plan_emergency_save(1, 0, 1, now=NOW, deadline=NOW + 1, margin_s=0)


def test_bandwidth_is_the_slowest_recent_checkpoint(tmp_path: Path) -> None:
    ckpt = Checkpointer(LocalStorage(tmp_path / "s"), tmp_path / "c", keep=2)
    assert ckpt.bandwidth() is None
    ckpt.history = [
        SaveTimings(
            1, snapshot_s=0.0, write_s=1.0, upload_s=0.1, verify_s=0.1, nbytes=10 * MB
        ),  # oldest: ignored
        SaveTimings(2, snapshot_s=0.5, write_s=0.5, upload_s=1.0, verify_s=1.0, nbytes=100 * MB),
        SaveTimings(3, snapshot_s=0.1, write_s=0.4, upload_s=4.0, verify_s=1.0, nbytes=100 * MB),
        SaveTimings(4, snapshot_s=0.1, write_s=0.9, upload_s=1.0, verify_s=0.0, nbytes=100 * MB),
    ]
    assert ckpt.bandwidth() == (100 * MB, 20 * MB)


# ---------------------------------------------------------------- payloads


AWS_ACTIONS = [
    ('{"action": "terminate", "time": "2027-01-15T08:22:00Z"}', "spot terminate", 1800001320.0),
    ('{"action": "hibernate", "time": "2027-01-15T08:22:00Z"}', "spot hibernate", 1800001320.0),
    ('{"action": "stop"}', "spot stop", None),
    ("<html>oops</html>", "spot unknown", None),
    ('{"action": "terminate", "time": "soon"}', "spot terminate", None),
]


@pytest.mark.parametrize(("body", "action", "deadline"), AWS_ACTIONS)
def test_aws_instance_action_always_stops(body: str, action: str, deadline: float | None) -> None:
    n = parse_aws_instance_action(body)
    assert (n.cloud, n.action, n.stop, n.deadline) == ("aws", action, True, deadline)


def test_aws_time_parses_as_utc() -> None:
    n = parse_aws_instance_action('{"action": "terminate", "time": "2017-09-18T08:22:00Z"}')
    assert n.deadline == 1505722920.0


def test_aws_rebalance_is_not_a_stop() -> None:
    n = parse_aws_rebalance('{"noticeTime": "2020-10-27T08:22:00Z"}')
    assert (n.stop, n.deadline, n.reason) == (False, None, "aws rebalance recommendation notice")


@pytest.mark.parametrize(("body", "stop"), [("TRUE", True), ("FALSE", False), ("true\n", True)])
def test_gcp_preempted(body: str, stop: bool) -> None:
    n = parse_gcp_preempted(body, NOW)
    assert (n is not None) == stop
    if n is not None:
        assert n.deadline == NOW + 30


def test_gcp_odd_answer_is_an_error() -> None:
    with pytest.raises(MetadataError, match="expected TRUE or FALSE"):
        parse_gcp_preempted("<html>", NOW)


AZURE = [
    ({"Events": []}, []),
    (
        {"Events": [{"EventId": "a", "EventType": "Preempt", "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT"}]},
        [("Preempt", True, 1474309787.0)],
    ),
    ({"Events": [{"EventId": "b", "EventType": "Preempt", "NotBefore": ""}]}, [("Preempt", True, NOW + 30)]),
    ({"Events": [{"EventId": "c", "EventType": "Terminate"}]}, [("Terminate", True, NOW + 30)]),
    ({"Events": [{"EventId": "d", "EventType": "Freeze", "NotBefore": ""}]}, [("Freeze", False, None)]),
]


@pytest.mark.parametrize(("doc", "expected"), AZURE)
def test_azure_events(doc: dict[str, object], expected: list[tuple[str, bool, float | None]]) -> None:
    got = [(n.action, n.stop, n.deadline) for n in parse_azure_events(json.dumps(doc), NOW)]
    assert got == expected


def test_azure_odd_answer_is_an_error() -> None:
    with pytest.raises(MetadataError, match="expected JSON"):
        parse_azure_events("not json", NOW)


# ---------------------------------------------------------------- the spec


def test_preemption_defaults_and_not_a_shape_field() -> None:
    spec = parse_spec(BASE)
    assert spec.preemption == PreemptionOptions(notice="none", poll_s=5.0, endpoint=None, save_margin_s=5.0)
    assert "preemption" not in SHAPE_FIELDS
    other = parse_spec({**BASE, "preemption": {"notice": "aws", "poll_s": 1}})
    assert other.shape_hash() == spec.shape_hash()
    assert all(f.description for f in PreemptionOptions.model_fields.values())


@pytest.mark.parametrize(
    ("opts", "needle"),
    [
        ({"poll_s": 6}, "field 'preemption.poll_s': poll_s 6 is too slow: GCP and Azure give"),
        ({"poll_s": 0}, "field 'preemption.poll_s'"),
        ({"notice": "ibm"}, "field 'preemption.notice'"),
        ({"endpoint": "169.254.169.254"}, "is not an http(s) URL: use e.g. http://169.254.169.254"),
        ({"save_margin_s": -1}, "field 'preemption.save_margin_s'"),
        ({"polls": 1}, "field 'preemption.polls' is not a field of 'preemption': did you mean 'poll_s'?"),
        ({"pols": 1, "poll_s": 1}, "remove it or check its spelling"),
    ],
)
def test_bad_preemption_options(opts: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_spec({**BASE, "preemption": opts})
    assert needle in str(e.value)


def test_make_watcher_endpoint_precedence() -> None:
    stop = StopRequest()
    assert make_watcher(PreemptionOptions(), stop) is None
    aws = make_watcher(PreemptionOptions(notice="aws"), stop)
    assert isinstance(aws, AwsWatcher) and aws.base_url == "http://169.254.169.254"
    gcp = make_watcher(PreemptionOptions(notice="gcp", endpoint="http://x:1/"), stop)
    assert isinstance(gcp, GcpWatcher) and gcp.base_url == "http://x:1"
    azure = make_watcher(PreemptionOptions(notice="azure", endpoint="http://x:1"), stop, None, "http://y:2")
    assert isinstance(azure, AzureWatcher) and azure.base_url == "http://y:2"


# ---------------------------------------------------------------- watchers against the stand-ins


@pytest.fixture
def imds() -> Iterator[FakeIMDS]:
    fake = FakeIMDS()
    yield fake
    fake.close()


def test_fake_imds_enforces_the_token_flow(imds: FakeIMDS) -> None:
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({})
    )  # loopback, whatever HTTP_PROXY says

    def status(method: str, path: str, headers: dict[str, str]) -> int:
        req = urllib.request.Request(imds.endpoint + path, method=method, headers=headers)
        try:
            with opener.open(req, timeout=2) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return e.code

    assert status("PUT", AWS_TOKEN, {AWS_TTL_HEADER: "21601"}) == 400
    assert status("PUT", AWS_TOKEN, {AWS_TTL_HEADER: "abc"}) == 400
    assert status("GET", AWS_INSTANCE_ACTION, {}) == 401
    assert status("GET", AWS_INSTANCE_ACTION, {"X-aws-ec2-metadata-token": "bad"}) == 401


def test_aws_no_notice_no_stop_then_notice_stops_with_its_time(imds: FakeIMDS) -> None:
    stop, seen = StopRequest(), []
    w = AwsWatcher(imds.endpoint, stop, poll_s=0.05, on_notice=seen.append).start()
    try:
        assert wait_until(lambda: imds.count("GET", AWS_INSTANCE_ACTION) >= 3)
        assert not stop.requested and seen == []
        when = imds.interrupt(in_seconds=120)
        assert wait_until(lambda: stop.requested)
    finally:
        w.close(wait_s=2)
    assert stop.deadline == when and stop.reason == "aws spot terminate notice"
    assert [(n.action, n.stop, n.deadline) for n in seen] == [("spot terminate", True, when)]
    assert imds.count("PUT", AWS_TOKEN) == 1  # one token for every poll while it is valid


def test_aws_rebalance_is_reported_once_and_training_goes_on(imds: FakeIMDS) -> None:
    stop, seen = StopRequest(), []
    w = AwsWatcher(imds.endpoint, stop, on_notice=seen.append)
    imds.rebalance()
    for _ in range(3):
        for n in w.poll():
            w._deliver(n)
    assert [n.action for n in seen] == ["rebalance recommendation"] and not stop.requested


def test_aws_token_renewed_before_expiry(imds: FakeIMDS) -> None:
    stop = StopRequest()
    w = AwsWatcher(imds.endpoint, stop, poll_s=0.05, token_ttl_s=1).start()
    try:
        assert wait_until(lambda: imds.count("PUT", AWS_TOKEN) >= 2, timeout=4)
    finally:
        w.close(wait_s=2)
    assert 401 not in imds.statuses  # renewed before it lapsed, not after a refusal
    assert w._failures == 0 and not stop.requested and imds.count("GET", AWS_INSTANCE_ACTION) > 5


def test_aws_401_gets_a_new_token_and_retries(imds: FakeIMDS) -> None:
    w = AwsWatcher(imds.endpoint, StopRequest())
    assert w.poll() == []
    imds.revoke_tokens()
    imds.interrupt(in_seconds=60)
    assert [n.action for n in w.poll()] == ["spot terminate"]
    assert imds.count("PUT", AWS_TOKEN) == 2


def test_endpoint_down_warns_once_and_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    stop, url = StopRequest(), unused_endpoint()
    with caplog.at_level(logging.WARNING, logger="spotrun.trainer.preemption.notices"):
        w = AwsWatcher(url, stop, poll_s=0.02, timeout_s=0.5).start()
        assert wait_until(lambda: w._failures >= 5)
        w.close(wait_s=2)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and url in warnings[0] and "SPOTRUN_IMDS_ENDPOINT" in warnings[0], warnings
    assert not stop.requested and w._thread is not None and not w._thread.is_alive()


def test_gcp_preemption_stops_within_30_s() -> None:
    fake, stop = FakeGCPMetadata(), StopRequest()
    try:
        w = GcpWatcher(fake.endpoint, stop, poll_s=0.05).start()
        assert wait_until(lambda: fake.count("GET", "/computeMetadata/v1/instance/preempted") >= 2)
        assert not stop.requested
        fake.preempt()
        assert wait_until(lambda: stop.requested)
        w.close(wait_s=2)
    finally:
        fake.close()
    assert stop.deadline is not None and 25 < stop.deadline - time.time() <= 30


def test_azure_preempt_stops_by_not_before_and_freeze_does_not() -> None:
    fake, stop, seen = FakeAzureEvents(), StopRequest(), []
    try:
        w = AzureWatcher(fake.endpoint, stop, poll_s=0.05, on_notice=seen.append).start()
        fake.add_event("Freeze")
        assert wait_until(lambda: len(seen) == 1)
        assert not stop.requested
        fake.add_event("Preempt", in_seconds=20)
        assert wait_until(lambda: stop.requested)
        w.close(wait_s=2)
    finally:
        fake.close()
    assert [n.action for n in seen] == ["Freeze", "Preempt"]
    assert stop.deadline is not None and 15 < stop.deadline - time.time() <= 21


def test_notice_record_is_plain_json() -> None:
    n = Notice("aws", "spot stop", True, deadline=NOW, key="{}")
    assert json.loads(json.dumps(n.record())) == {
        "cloud": "aws",
        "action": "spot stop",
        "stop": True,
        "deadline": NOW,
    }


# ---------------------------------------------------------------- heartbeat


def test_heartbeat_contract(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "store")
    hb = HeartbeatWriter(storage, "w1", every_s=3600).start()
    assert wait_until(lambda: read_heartbeat(storage, "w1") is not None)
    first = read_heartbeat(storage, "w1")
    assert first is not None and first["records"] == {} and first["worker_id"] == "w1"
    hb(Started(t=1.0, resumed_from=None, step=0, total_steps=9))
    hb(Step(t=2.0, step=5, loss=0.5, steps_per_s=3.0, durable_step=None))
    hb(Durable(t=3.0, step=5))
    hb(Step(t=3.5, step=6, loss=0.1 + 0.2, steps_per_s=3.0, durable_step=5))
    hb(Exit(t=4.0, code=75, name="PREEMPTED", error="", step=6, durable_step=5))
    doc = read_heartbeat(storage, "w1")  # the exit write is synchronous: no waiting
    hb.close()
    assert doc is not None
    assert set(doc) == {"worker_id", "t", "pid", "last_step", "durable_step", "losses", "records"}
    assert heartbeat_losses(doc) == {6: 0.1 + 0.2}  # the steps after the durable one, bitwise
    assert (doc["last_step"], doc["durable_step"]) == (6, 5)
    assert doc["records"]["exit"]["name"] == "PREEMPTED" and doc["records"]["step"]["step"] == 6
    assert [r.kind for r in heartbeat_records(doc)] == ["started", "durable", "step", "exit"]
    assert [o.key for o in storage.list()] == [heartbeat_key("w1")] == ["_workers/w1/heartbeat.json"]


def test_heartbeat_write_failures_never_raise(tmp_path: Path) -> None:
    class Broken(LocalStorage):
        def put(self, key: str, src: Path) -> None:
            raise OSError("disk on fire")

    hb = HeartbeatWriter(Broken(tmp_path / "s"), "w1").start()
    hb(Exit(t=1.0, code=1))
    hb.close()
    assert hb.failures >= 1 and hb.writes == 0


def test_checkpoint_listing_ignores_workers(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    put_bytes(storage, "_workers/w1/heartbeat.json", b"{}")
    put_bytes(storage, "step_000000007/manifest.json", b"{}")
    assert list(list_checkpoints(storage)) == [7]


@pytest.mark.parametrize("bad", ["a/b", "", "../x", ".hidden", "x" * 129])
def test_worker_id_must_be_a_plain_name(bad: str) -> None:
    with pytest.raises(ConfigError, match="worker id"):
        heartbeat_key(bad)
