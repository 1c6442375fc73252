"""Run keys: templating, reading a key back into its slot, resolution, and which run a warm start picks."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from spotrun.tasks.history import StoreUnavailable
from spotrun.tasks.history.models import JobRunRow, JobStatus
from spotrun.tasks.retraining.run_keys import (
    Lineage,
    Slot,
    keyed_record,
    keys_to_run,
    pick_source,
    resolve,
    resolve_job_run,
    slot_values,
    values_for_key,
)
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.spec.job import JobSpec, parse_spec
from spotrun.trainer.spec.runs import RunSource
from spotrun.trainer.spec.templating import fill

NIGHT = datetime(2026, 12, 5, 3, 0, tzinfo=UTC)


def nightly(**more: Any) -> JobSpec:
    base = {
        "name": "charlm-nightly",
        "recipe": "digits",
        "total_steps": 10,
        "storage": "/ck/charlm-nightly",
        "run_key": "{scheduled_date}",
        "args": {"data": "/data/{scheduled_date}/part", "lr": 0.1},
    }
    return parse_spec(base | more)


@pytest.mark.parametrize(
    ("text", "values", "expected"),
    [
        ("{scheduled_date}", {"scheduled_date": "2026-12-05"}, "2026-12-05"),
        ("v{{1}}-{run_key}", {"run_key": "k"}, "v{1}-k"),
        ("plain", {}, "plain"),
    ],
)
def test_fill(text: str, values: dict[str, str], expected: str) -> None:
    assert fill(text, values) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{nope}", "unknown placeholder {nope}"),
        ("{scheduled_date.__class__}", "unknown placeholder"),
        ("a}b", "write }} for a literal brace"),
        ("{flow_run_name}", "{flow_run_name} has no value here"),
    ],
)
def test_fill_refuses(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("{", r"\{").replace("}", r"\}")):
        fill(text, {"scheduled_date": "x"}, "run_key")


@pytest.mark.parametrize(
    ("slot", "date", "time"),
    [
        (Slot(NIGHT), "2026-12-05", "20261205T030000"),
        (Slot(NIGHT, "America/Los_Angeles"), "2026-12-04", "20261204T190000"),  # the schedule's night
        (Slot(NIGHT, "Asia/Tokyo"), "2026-12-05", "20261205T120000"),
    ],
)
def test_slot_values_follow_the_schedules_timezone(slot: Slot, date: str, time: str) -> None:
    assert slot_values(slot)["scheduled_date"] == date
    assert slot_values(slot)["scheduled_time"] == time


@pytest.mark.parametrize(
    ("template", "key", "expected"),
    [
        (
            "{scheduled_date}",
            "2026-12-01",
            {"scheduled_date": "2026-12-01", "scheduled_time": "20261201T000000"},
        ),
        ("night-{scheduled_date}", "night-2026-12-01", {"scheduled_date": "2026-12-01"}),
        (
            "{scheduled_time}",
            "20261201T030000",
            {"scheduled_date": "2026-12-01", "scheduled_time": "20261201T030000"},
        ),
        ("{flow_run_name}", "eager-otter", {"flow_run_name": "eager-otter"}),
    ],
)
def test_a_literal_key_reads_back_into_its_slot(template: str, key: str, expected: dict[str, str]) -> None:
    values = values_for_key(template, key)
    assert {k: values[k] for k in expected} == expected
    assert fill(template, values) == key


@pytest.mark.parametrize(
    ("template", "key", "message"),
    [
        ("{scheduled_date}", "yesterday", "does not fit run_key"),
        ("{scheduled_date}", "2026-13-40", "not a real date"),
        ("{scheduled_date}", "../etc", "not one path component"),
    ],
)
def test_a_key_that_does_not_fit_is_refused(template: str, key: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        values_for_key(template, key)


def test_resolve_fills_key_args_and_storage_once() -> None:
    job = nightly(init_from={"job": "charlm-nightly"})
    source = RunSource(
        job="charlm-nightly", run_key="2026-12-04", storage="/ck/charlm-nightly/2026-12-04", step=10
    )
    resolved = resolve(job, slot_values(Slot(NIGHT)), Lineage(init_from=source))
    assert resolved.run_key == "2026-12-05"
    assert resolved.storage == "/ck/charlm-nightly/2026-12-05"
    assert resolved.args == {"data": "/data/2026-12-05/part", "lr": 0.1}
    assert resolved.run_values["run_key"] == "2026-12-05"
    assert resolved.init_from is not None and resolved.init_from.source == source
    assert resolve(resolved, slot_values(Slot(datetime(2027, 1, 1, tzinfo=UTC))), Lineage()) == resolved
    record = keyed_record(resolved)
    assert record is not None and record.run_key == "2026-12-05"
    assert record.lineage["init_from"]["run_key"] == "2026-12-04"


def row(key: str | None, status: JobStatus, ended: float, promoted: bool | None = None) -> JobRunRow:
    promotion = None if promoted is None else {"promoted": promoted, "version": "3"}
    return JobRunRow(
        id=f"run-{key}",
        job="j",
        spec_hash="",
        flow_run_id=None,
        storage_uri=f"/ck/j/{key}",
        provider="local",
        status=status,
        message="",
        started_at=ended - 10,
        ended_at=ended,
        run_key=key,
        promotion=promotion,
    )


RUNS = [
    row("d1", JobStatus.COMPLETED, 100, promoted=True),
    row("d2", JobStatus.COMPLETED, 200, promoted=False),
    row("d3", JobStatus.FAILED, 300),
    row("d4", JobStatus.RUNNING, 400),
]


@pytest.mark.parametrize(
    ("which", "this_key", "expected"),
    [
        ("latest-completed", "d5", "d2"),  # the failed and the running ones are no source
        ("latest-completed", "d2", "d1"),  # never itself
        ("best", "d5", "d1"),  # the newest promoted: the run the alias holds
        ("d1", "d5", "d1"),
        ("d3", "d5", None),  # that key did not complete
        ("latest-completed", "d1", "d2"),
    ],
)
def test_pick_source(which: str, this_key: str, expected: str | None) -> None:
    picked = pick_source(RUNS, which, this_key)
    assert (picked.run_key if picked else None) == expected


def test_pick_source_with_no_runs_is_none() -> None:
    assert pick_source([], "latest-completed", "d1") is None
    assert pick_source([row("d1", JobStatus.COMPLETED, 1, promoted=False)], "best", "d2") is None


class FakeHistory:
    def __init__(self, runs: list[JobRunRow], down: bool = False) -> None:
        self.runs, self.down = runs, down

    def job_runs(
        self, job: str | None = None, limit: int = 50, run_key: str | None = None
    ) -> list[JobRunRow]:
        if self.down:
            raise StoreUnavailable("history database sqlite:///x is unreachable")
        return [r for r in self.runs if r.job == job and (run_key is None or r.run_key == run_key)]

    def latest_job_run(self, job: str, run_key: str | None = None) -> JobRunRow | None:
        runs = self.job_runs(job, run_key=run_key)
        return runs[-1] if runs else None

    def job_run_of_flow_run(self, flow_run_id: str) -> JobRunRow | None:
        return next((r for r in self.runs if r.flow_run_id == flow_run_id), None)


def started(key: str, flow_run: str, values: dict[str, str]) -> JobRunRow:
    return JobRunRow(
        id=f"run-{key}",
        job="charlm-nightly",
        spec_hash="",
        flow_run_id=flow_run,
        storage_uri="",
        provider="local",
        status=JobStatus.RUNNING,
        message="",
        started_at=1.0,
        ended_at=None,
        run_key=key,
        run_values=values | {"run_key": key},
        lineage={"init_note": "x"},
    )


def test_a_rerun_of_the_key_gets_the_first_flow_runs_values_back() -> None:
    first = resolve(nightly(), slot_values(Slot(NIGHT, flow_run_name="first")), Lineage())
    history = FakeHistory([started("2026-12-05", "crashed-id", dict(first.run_values))])
    later = Slot(datetime(2026, 12, 6, 0, 30, tzinfo=UTC), flow_run_name="second")  # past midnight
    # recover-job's rerun: a new name, a new day, but the crashed run's key and values
    again, how = resolve_job_run(nightly(), history, later, recovers="crashed-id")
    assert again == first and "continuing" in how
    # a retry or double click on the same night finds the key's job run by its key
    same_night = Slot(datetime(2026, 12, 5, 9, 0, tzinfo=UTC), flow_run_name="third")
    assert resolve_job_run(nightly(), history, same_night)[0] == first
    # a backfill of that key too
    assert resolve_job_run(nightly(), history, later, run_key="2026-12-05")[0] == first


def test_a_new_key_and_a_database_that_is_down() -> None:
    job = nightly(init_from={"job": "charlm-nightly"})
    fresh, how = resolve_job_run(job, FakeHistory([]), Slot(NIGHT))
    assert fresh.run_key == "2026-12-05" and "a new job run" in how
    assert fresh.init_from is not None and fresh.init_from.source is None  # the first night
    down, how = resolve_job_run(job, FakeHistory([], down=True), Slot(NIGHT))
    assert down.run_key == "2026-12-05" and "unreachable" in how


def test_unkeyed_jobs_pass_through() -> None:
    job = parse_spec({"name": "digits", "recipe": "digits", "total_steps": 5})
    assert resolve_job_run(job, FakeHistory([], down=True), Slot(NIGHT)) == (job, "")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, ["2026-12-05"]),  # today's key, in UTC
        ("2026-12-01", ["2026-12-01"]),
        ("2026-11-30..2026-12-02", ["2026-11-30", "2026-12-01", "2026-12-02"]),
        ("2026-12-02..2026-12-02", ["2026-12-02"]),
    ],
)
def test_keys_to_run(text: str | None, expected: list[str]) -> None:
    assert keys_to_run(nightly(), text, now=NIGHT) == expected


@pytest.mark.parametrize(
    ("job", "text", "message"),
    [
        (nightly(), "2026-12-03..2026-12-01", "FIRST <= LAST"),
        (nightly(), "2025-01-01..2026-12-01", "at most 366 days"),
        (nightly(run_key="{flow_run_name}"), "a..b", "needs a run_key of dates"),
        (parse_spec({"name": "d", "recipe": "digits", "total_steps": 5}), "2026-12-01", "has no run_key"),
    ],
)
def test_keys_to_run_refuses(job: JobSpec, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        keys_to_run(job, text, now=NIGHT)
