"""Table tests of the one-run-per-job guard's decisions and of the worker restart backoff."""

from __future__ import annotations

from datetime import UTC, datetime

import httpx
import pytest
from prefect import flow
from prefect.concurrency.asyncio import ConcurrencySlotAcquisitionError
from prefect.states import Completed, State

from spotrun.deployments.worker import RestartBackoff
from spotrun.tasks.decisions.policy import RetryPolicy
from spotrun.tasks.ownership.job_slot import (
    ORPHAN_S,
    RunningRun,
    holder_of,
    job_slot,
    limit_name,
    on_busy,
    one_run_per_job,
    server_busy,
    while_busy,
)
from spotrun.trainer.spec.job import JobSpec


@flow
@one_run_per_job
def guarded(job: JobSpec, note: str = "", policy: RetryPolicy = RetryPolicy()) -> State:  # noqa: B008
    return Completed(message=f"{job.name} {note} {policy.duplicate_runs}")


def run(id_: str, job: str, minute: int | None) -> RunningRun:
    started = None if minute is None else datetime(2026, 1, 1, 3, minute, tzinfo=UTC)
    return RunningRun(id_, f"run-{id_}", job, started)


@pytest.mark.parametrize(
    ("runs", "holder"),
    [
        ([], None),
        ([run("me", "a", 0)], None),  # only itself
        ([run("x", "b", 0)], None),  # another job
        ([run("me", "a", 0), run("x", "a", 5)], "x"),
        ([run("y", "a", 9), run("x", "a", 5), run("me", "a", 7)], "x"),  # the earliest: later ones wait
        ([run("y", "a", None), run("x", "a", 5)], "x"),  # not started yet: not the holder
        ([run("y", "a", None)], "y"),
    ],
)
def test_holder_is_the_earliest_other_running_run_of_the_job(
    runs: list[RunningRun], holder: str | None
) -> None:
    found = holder_of(runs, "a", "me")
    assert (found.id if found else None) == holder


@pytest.mark.parametrize(
    ("policy", "holder", "wait", "says"),
    [
        ("wait", run("x", "a", 0), True, "job a is already running in flow run run-x (x); waiting"),
        ("reject", run("x", "a", 0), False, "job a is already running in flow run run-x (x); refused"),
        ("wait", None, True, "spotrun-job:a comes back within 75 s); waiting"),
        ("reject", None, False, "no running run of it is listed"),
    ],
)
def test_busy_policy(policy: str, holder: RunningRun | None, wait: bool, says: str) -> None:
    busy = on_busy("a", policy, holder)  # type: ignore[arg-type]
    assert busy.wait is wait and says in busy.message
    assert "\n" not in busy.message


@pytest.mark.parametrize(("policy", "wait"), [("wait", True), ("reject", False)])
def test_a_paused_job_says_how_to_resume(policy: str, wait: bool) -> None:
    busy = on_busy("a", policy, None, paused=True)  # type: ignore[arg-type]
    assert busy.wait is wait and "spotrun-job:a is set to 0 (paused); raise it to 1" in busy.message


@pytest.mark.parametrize(
    ("free", "holder", "paused", "alone_since", "now", "action", "since"),
    [
        (True, False, False, None, 100.0, "take", None),
        (True, False, False, 50.0, 100.0, "take", None),
        (False, True, False, None, 100.0, "wait", None),
        (False, True, False, 50.0, 100.0, "wait", None),  # a holder appeared: the clock starts again
        (False, False, True, 1.0, 1000.0, "wait", None),  # paused (limit 0): never freed
        (False, False, False, None, 100.0, "wait", 100.0),  # no holder: the clock starts
        (False, False, False, 100.0, 100.0 + ORPHAN_S - 1, "wait", 100.0),  # a lapsing lease: wait
        (False, False, False, 100.0, 100.0 + ORPHAN_S, "free", 100.0),  # lost lease: free it
    ],
)
def test_while_busy(
    free: bool,
    holder: bool,
    paused: bool,
    alone_since: float | None,
    now: float,
    action: str,
    since: float | None,
) -> None:
    assert while_busy(free, holder, paused, alone_since=alone_since, now=now) == (action, since)


def test_orphans_wait_out_a_lapsing_lease() -> None:
    assert ORPHAN_S > 60 + 15  # lease plus the repossessor's loop: a dead holder's slot frees itself first


def test_limit_name_and_policy_default() -> None:
    assert limit_name("charlm-nightly") == "spotrun-job:charlm-nightly"
    assert RetryPolicy().duplicate_runs == "wait"
    with pytest.raises(ValueError, match="duplicate_runs"):
        RetryPolicy.model_validate({"duplicate_runs": "queue"})


def test_guard_is_a_no_op_outside_a_flow_run() -> None:
    with job_slot("a", "reject") as refused:
        assert refused is None


def test_a_guarded_flow_keeps_its_parameters_and_runs_as_fn() -> None:
    assert list(guarded.parameters.properties) == ["job", "note", "policy"]
    assert "duplicate_runs" in str(guarded.parameters.definitions)
    spec = JobSpec.model_validate({"name": "a", "recipe": "digits", "total_steps": 10, "storage": "/tmp/x"})
    state = guarded.fn(spec, "n", policy=RetryPolicy(duplicate_runs="reject"))
    assert state.message == "a n reject"
    # what a deployment run does first, resolving the annotations outside the flow's module
    params = guarded.validate_parameters({"job": spec.model_dump(mode="json"), "policy": {"max_errors": 1}})
    assert params["job"] == spec and params["policy"] == RetryPolicy(max_errors=1)


@pytest.mark.parametrize(
    ("uptimes", "delays"),
    [
        ([0], [1]),
        ([0, 0, 0, 0], [1, 2, 4, 8]),
        ([0] * 9, [1, 2, 4, 8, 16, 32, 60, 60, 60]),  # dying in a loop: retried at the cap, forever
        ([0, 0, 0, 400, 0], [1, 2, 4, 1, 2]),  # up 400 s (stable): the sequence starts again
        ([0, 0, 299], [1, 2, 4]),
    ],
)
def test_restart_backoff(uptimes: list[float], delays: list[float]) -> None:
    backoff = RestartBackoff()
    assert [backoff.next_delay(u) for u in uptimes] == delays


def _refused(cause: BaseException) -> ConcurrencySlotAcquisitionError:
    error = ConcurrencySlotAcquisitionError("Unable to acquire concurrency slots")
    error.__cause__ = cause
    return error


def _status(code: int) -> httpx.HTTPStatusError:
    request = httpx.Request("POST", "http://127.0.0.1:4200/api/v2/concurrency_limits/increment-with-lease")
    return httpx.HTTPStatusError(str(code), request=request, response=httpx.Response(code, request=request))


@pytest.mark.parametrize(
    ("cause", "busy"),
    [
        (_status(503), True),  # a locked SQLite server (bench/scale.py, 50 jobs)
        (_status(429), True),
        (_status(502), True),
        (httpx.ConnectError("refused"), True),
        (_status(404), False),  # an answer: no such limit
        (_status(422), False),
        (ValueError("bad"), False),
    ],
)
def test_a_busy_server_is_asked_again_for_the_slot_and_an_answer_is_not(
    cause: BaseException, busy: bool
) -> None:
    assert server_busy(_refused(cause)) is busy
