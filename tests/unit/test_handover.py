"""Training through a notice: when the old trainer stops (a table), and the standby record it reads."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from spotrun.trainer.preemption.handover import (
    ANNOUNCE_S,
    Handover,
    Standby,
    read_standby,
    stop_now,
    write_standby,
)
from spotrun.trainer.storage import open_storage

ME = "local-100"


def standby(state: str, replacing: str = ME) -> Standby:
    return Standby(replacing=replacing, state=state, worker="local-200", at=0.0)


@pytest.mark.parametrize(
    ("record", "since", "left", "stops"),
    [
        (None, 0.2, 5.0, None),  # just noticed: the controller has not announced yet
        (None, ANNOUNCE_S, 5.0, "no replacement announced"),  # nobody is coming (a cancel)
        (standby("starting"), 0.2, 5.0, None),  # announced: train on
        (standby("starting"), 4.0, 5.0, None),  # still building, time left: train on
        (standby("starting"), 4.0, 0.0, "no time left"),  # the checkpoint needs the rest
        (standby("waiting"), 0.3, 5.0, "stands by"),  # ready: stop, save, give the lease back
        (standby("waiting", replacing="local-99"), 0.3, 5.0, None),  # an earlier handover's record
        (standby("waiting", replacing="local-99"), ANNOUNCE_S, 5.0, "no replacement announced"),
        (None, 0.0, -1.0, "no time left"),  # a deadline too close for any more training
    ],
)
def test_when_the_old_trainer_stops(
    record: Standby | None, since: float, left: float, stops: str | None
) -> None:
    why = stop_now(record, ME, since, left_s=left)
    assert (why is None) if stops is None else (why is not None and stops in why), why


def test_standby_round_trip_and_bad_records(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path / "store"))
    assert read_standby(storage) is None
    write_standby(storage, ME, "starting")
    got = read_standby(storage)
    assert got is not None and (got.replacing, got.state, got.worker) == (ME, "starting", "")
    write_standby(storage, ME, "waiting", "local-200")
    got = read_standby(storage)
    assert got is not None and (got.state, got.worker) == ("waiting", "local-200")
    (tmp_path / "store" / "_standby.json").write_text("{not json")
    assert read_standby(storage) is None  # unreadable: the handover just ends at its announcement window


def test_handover_ends_when_the_replacement_stands_by(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path / "store"))
    write_standby(storage, ME, "starting")
    h = Handover(storage, ME, budget_s=30)
    time.sleep(0.3)
    assert not h.ready  # announced, not yet waiting
    write_standby(storage, ME, "waiting", "local-200")
    deadline = time.monotonic() + 5
    while not h.ready and time.monotonic() < deadline:
        time.sleep(0.02)
    assert h.ready and h.reason is not None and "local-200 stands by" in h.reason


def test_handover_without_an_announcement_ends_at_the_window(tmp_path: Path) -> None:
    h = Handover(open_storage(str(tmp_path / "store")), ME, budget_s=30)
    deadline = time.monotonic() + 10
    while not h.ready and time.monotonic() < deadline:
        time.sleep(0.05)
    assert h.ready and h.reason is not None and "no replacement announced" in h.reason
    assert h.waited_s >= ANNOUNCE_S


class HangingStorage:
    """A storage whose reads hang (an S3 endpoint that stopped answering)."""

    uri = "s3://hangs/job"

    def read(self, key: str) -> list[bytes]:
        time.sleep(30)
        return []


def test_the_time_limit_holds_while_a_storage_read_hangs() -> None:
    h = Handover(HangingStorage(), ME, budget_s=0.3)  # type: ignore[arg-type]
    assert not h.ready
    time.sleep(0.4)
    assert h.ready and h.reason is not None and "no time left" in h.reason  # read on the loop's clock


def test_a_second_stop_request_ends_the_handover_and_ec2_waits_longer_for_its_announcement(
    tmp_path: Path,
) -> None:
    storage = open_storage(str(tmp_path / "store"))
    write_standby(storage, ME, "starting")
    h = Handover(storage, ME, budget_s=30)
    h.end("a second stop request")
    assert h.ready and h.reason == "a second stop request"
    assert stop_now(None, ME, since_notice_s=5.0, left_s=60.0, announce_s=15.0) is None  # EC2: poll + beat
    assert "within 15 s" in (stop_now(None, ME, since_notice_s=15.0, left_s=60.0, announce_s=15.0) or "")
