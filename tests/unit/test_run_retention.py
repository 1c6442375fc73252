"""Retention across a keyed job's runs (tasks/retraining/run_retention.py): which keys go, as a table; and
deleting them, only ever one key's own prefix below the job's storage, in a directory and on S3 (moto)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from spotrun.tasks.retraining.run_retention import (
    RunRecord,
    base_storage,
    champion_key,
    delete_prefix,
    lineage_keys,
    own_prefix_problem,
    protected_keys,
    prune_runs,
    read_keys,
    runs_to_prune,
)
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import LocalStorage, open_storage, put_bytes
from spotrun.trainer.storage.options import S3Options

BASE = "/data/ckpt/nightly"


def _run(
    key: str, day: int, status: str = "completed", *, storage: str | None = None, job: str = "nightly"
) -> RunRecord:
    return RunRecord(
        job,
        key,
        storage or f"{BASE}/{key}",
        status=status,
        started_at=float(day * 86400),
        job_run_id=f"jr-{key}",
    )


def _night(day: int, status: str = "completed") -> RunRecord:
    return _run(f"2026-12-{day:02d}", day, status)


# (case, runs, keep, in flight, protected, the keys that go)
CASES: list[tuple[str, list[RunRecord], int, set[str], set[str], list[str]]] = [
    ("fewer completed than keep", [_night(1), _night(2)], 3, set(), set(), []),
    ("exactly keep", [_night(1), _night(2), _night(3)], 3, set(), set(), []),
    ("the oldest go, oldest first", [_night(d) for d in (3, 1, 5, 2, 4)], 2, set(), set(),
     ["2026-12-01", "2026-12-02", "2026-12-03"]),
    ("a failed night newer than the oldest kept stays",
     [_night(1), _night(2), _night(3, "failed"), _night(4)], 2, set(), set(), ["2026-12-01"]),
    ("a failed night older than the kept ones goes", [_night(1, "failed"), _night(2), _night(3)], 1, set(),
     set(), ["2026-12-01", "2026-12-02"]),
    ("failed nights do not count towards keep", [_night(1), _night(2, "failed"), _night(3, "failed")], 1,
     set(), set(), []),
    ("never a key in flight", [_night(1), _night(2), _night(3)], 1, {"2026-12-01"}, set(), ["2026-12-02"]),
    ("never a running key, in flight or not", [_night(1, "running"), _night(2), _night(3)], 1, set(), set(),
     ["2026-12-02"]),
    ("never a protected key (the champion, a source)", [_night(1), _night(2), _night(3)], 1, set(),
     {"2026-12-01"}, ["2026-12-02"]),
    ("a key completed by a second job run: that run's start counts",
     [_night(1), _run("2026-12-02", 2, "failed"), _run("2026-12-02", 6), _night(3), _night(4)], 2, set(),
     set(), ["2026-12-01", "2026-12-03"]),
    ("a rerun of a completed key makes it no newer",
     [_night(1), _run("2026-12-01", 9), _night(2), _night(3)], 2, set(), set(), ["2026-12-01"]),
    ("unkeyed runs are never pruned",
     [RunRecord("nightly", None, BASE, status="completed", started_at=0.0), _night(1), _night(2)], 1, set(),
     set(), ["2026-12-01"]),
    ("equal start times: the key breaks the tie", [_run("a", 1), _run("b", 1), _run("c", 1)], 1, set(), set(),
     ["a", "b"]),
]  # fmt: skip  # one case per line: a table


@pytest.mark.parametrize(
    ("runs", "keep", "in_flight", "protected", "gone"), [pytest.param(*c[1:], id=c[0]) for c in CASES]
)
def test_runs_to_prune(
    runs: list[RunRecord], keep: int, in_flight: set[str], protected: set[str], gone: list[str]
) -> None:
    picked = runs_to_prune(runs, keep, in_flight, protected)
    assert list(dict.fromkeys(r.run_key for r in picked)) == gone
    assert all(r in runs for r in picked)


def test_every_job_run_of_a_key_goes_with_it_and_keep_is_at_least_one() -> None:
    runs = [_run("k1", 1, "failed"), _run("k1", 2), _run("k2", 3)]
    assert [r.started_at for r in runs_to_prune(runs, 1)] == [86400.0, 172800.0]
    with pytest.raises(ConfigError, match="at least 1"):
        runs_to_prune(runs, 0)


def _job(storage: str, **extra: Any) -> JobSpec:
    return JobSpec.model_validate(
        {"name": "nightly", "recipe": "digits", "total_steps": 10, "storage": storage} | extra
    )


SOURCE = {"job": "nightly", "run_key": "2026-12-02", "storage": f"{BASE}/2026-12-02", "step": 10}


def test_the_keys_a_run_reads_are_protected() -> None:
    resolved = _job(
        f"{BASE}/2026-12-05",
        run_key="2026-12-05",
        run_values={"run_key": "2026-12-05"},
        init_from={"job": "nightly", "source": SOURCE},
        promote={"champion": SOURCE | {"run_key": "2026-12-01"}},
        keep_runs=2,
    )
    assert protected_keys(resolved) == {"2026-12-01", "2026-12-02"}
    assert base_storage(resolved) == BASE and base_storage(_job(BASE)) == BASE
    other = _job(BASE, init_from={"job": "daily", "source": SOURCE | {"job": "daily"}})
    assert protected_keys(other) == set()  # another job's key: that job's retention protects it
    lineage = {"init_from": SOURCE, "init_note": "", "champion": SOURCE | {"run_key": "2026-12-03"}}
    assert lineage_keys("nightly", lineage) == {"2026-12-02", "2026-12-03"}
    assert lineage_keys("nightly", None) == lineage_keys("daily", lineage) == set()


@pytest.mark.parametrize(
    ("run", "problem"),
    [
        (_run("2026-12-01", 1), None),
        (_run("2026-12-01", 1, storage=f"{BASE}/2026-12-01/"), None),
        (_run("2026-12-01", 1, storage=BASE), "is not /data/ckpt/nightly/2026-12-01"),  # the base itself
        (_run("2026-12-01", 1, storage="/data/ckpt/other/2026-12-01"), "is not"),
        (_run("2026-12-01", 1, storage=f"{BASE}/2026-12-01/deeper"), "is not"),
        (_run("..", 1, storage="/data/ckpt"), "not one path component"),
        (_run("2026-12-01", 1, storage="ckpt/nightly/2026-12-01"), "relative"),
    ],
)
def test_only_a_prefix_one_key_below_the_base_may_be_deleted(run: RunRecord, problem: str | None) -> None:
    found = own_prefix_problem(run, BASE)
    assert found is None if problem is None else problem in (found or "")


class Limits:
    """The Prefect limits the prune deletes, by name (a hand-written stand-in for the server)."""

    def __init__(self, names: set[str], fail: bool = False) -> None:
        self.names, self.fail, self.asked = names, fail, []  # type: list[str]

    def __call__(self, name: str) -> bool:
        self.asked.append(name)
        if self.fail:
            raise ConnectionError("no server")
        if name in self.names:
            self.names.remove(name)
            return True
        return False


def _fill(store: LocalStorage, key: str, n: int = 3) -> None:
    for i in range(n):
        put_bytes(store, f"{key}/step-{i:08d}/model.safetensors", b"x")
    put_bytes(store, f"{key}/COMPLETED.json", b"{}")


def test_prune_runs_deletes_old_prefixes_and_their_limits_and_nothing_else(tmp_path: Path) -> None:
    base = tmp_path / "nightly"
    store = LocalStorage(base)
    keys = [f"2026-12-0{d}" for d in range(1, 6)]
    for k in keys:
        _fill(store, k)
    (base / "2026-12-01" / "_lease.json.spotrun-lock").write_text("")  # put_if's lock: never listed
    (base / "2026-12-010").mkdir()  # a sibling sharing the prefix's first characters
    (base / "2026-12-010" / "keep.txt").write_text("mine")
    runs = [
        RunRecord("nightly", k, str(base / k), status="completed", started_at=float(i), job_run_id=f"jr{i}")
        for i, k in enumerate(keys)
    ]
    runs[4] = RunRecord("nightly", keys[4], str(base / keys[4]), status="running", started_at=4.0)
    runs.append(
        RunRecord("nightly", "2026-11-30", str(tmp_path / "elsewhere"), status="completed", started_at=-1.0)
    )
    limits = Limits({f"spotrun-job:nightly@{k}" for k in keys})
    job = _job(str(base), run_key="{scheduled_date}", keep_runs=2)
    report = prune_runs(job, runs, delete_limit=limits, protected={"2026-12-02"})
    assert report.pruned == ["2026-12-01"] and report.objects == 4
    assert report.limits == ["spotrun-job:nightly@2026-12-01"]
    assert report.skipped and "2026-11-30" in report.skipped[0] and not report.errors
    assert sorted(p.name for p in base.iterdir()) == ["2026-12-010", *keys[1:]]  # the lock file went too
    assert (base / "2026-12-010" / "keep.txt").read_text() == "mine"
    assert (tmp_path / "elsewhere").exists() is False  # never created, never touched
    assert "deleted 1 run key(s) (2026-12-01; 4 objects)" in report.line()
    again = prune_runs(job, runs, delete_limit=limits, protected={"2026-12-02"})
    assert again.pruned == [] and again.limits == []  # done already: nothing to report
    no_keep = prune_runs(_job(str(base)), runs, delete_limit=limits)
    assert no_keep.line() == "retention: nothing to delete" and len(limits.asked) == 2


def test_a_failure_is_reported_not_raised(tmp_path: Path) -> None:
    base = tmp_path / "nightly"
    store = LocalStorage(base)
    for k in ("a", "b"):
        _fill(store, k, 1)
    runs = [
        RunRecord("nightly", k, str(base / k), status="completed", started_at=float(i))
        for i, k in enumerate("ab")
    ]
    report = prune_runs(
        _job(str(base), run_key="{scheduled_date}"), runs, keep=1, delete_limit=Limits(set(), True)
    )
    assert report.pruned == ["a"] and "no server" in report.errors[0]


def test_delete_prefix_on_s3_leaves_the_neighbours(s3_bucket: tuple[str, str]) -> None:
    endpoint, bucket = s3_bucket
    opts = S3Options(endpoint_url=endpoint)
    base = f"s3://{bucket}/ckpt/nightly"
    store = open_storage(base, opts)
    for k in ("2026-12-01", "2026-12-010", "2026-12-02"):
        put_bytes(store, f"{k}/step-00000010/model.safetensors", b"x")
    runs = [
        RunRecord("nightly", k, f"{base}/{k}", status="completed", started_at=float(i))
        for i, k in enumerate(["2026-12-01", "2026-12-02"])
    ]
    job = _job(base, run_key="{scheduled_date}", keep_runs=1, s3={"endpoint_url": endpoint})
    report = prune_runs(job, runs, delete_limit=Limits(set()))
    assert report.pruned == ["2026-12-01"] and report.objects == 1
    assert sorted(o.key for o in store.list()) == [
        "2026-12-010/step-00000010/model.safetensors",
        "2026-12-02/step-00000010/model.safetensors",
    ]
    assert delete_prefix(f"{base}/2026-12-01", opts) == 0


def test_the_champion_and_what_running_runs_read_are_never_pruned(tmp_path: Path) -> None:
    base = tmp_path / "nightly"
    store = LocalStorage(base)
    keys = [f"2026-12-0{d}" for d in range(1, 7)]
    for k in keys:
        _fill(store, k, 1)

    def rec(i: int, **kw: Any) -> RunRecord:
        return RunRecord(
            "nightly",
            keys[i],
            str(base / keys[i]),
            status=kw.pop("status", "completed"),
            started_at=float(i),
            **kw,
        )

    source = {"job": "nightly", "run_key": keys[1], "storage": str(base / keys[1]), "step": 1}
    runs = [
        rec(0, promoted=True, ended_at=10.0),  # promoted, then beaten by key 3: no longer the champion
        rec(1),  # the warm-start source of the running night
        rec(2, promoted=True, ended_at=3.0),  # the champion (the newest promoted by its end)
        rec(3),
        rec(4),
        rec(5, status="running", lineage={"init_from": source, "champion": None}),
    ]
    runs[0] = replace(runs[0], ended_at=1.0)
    assert champion_key(runs) == keys[2] and read_keys("nightly", runs) == {keys[1]}
    report = prune_runs(_job(str(base), run_key="{scheduled_date}"), runs, keep=2, delete_limit=Limits(set()))
    assert report.pruned == [keys[0]]
    assert sorted(p.name for p in base.iterdir()) == keys[1:]
