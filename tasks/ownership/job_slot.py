"""One flow run per job: the training flow holds the only slot of a Prefect global concurrency limit
named after the job for its whole run, so a second run of the job (a nightly run overlapping a slow
one, a double click in the UI) waits or is refused before it starts a worker.

This is the orchestration-level guard; the storage lease is the hard guarantee. Slots are held with a
lease the flow renews in a background thread: a holder that is SIGKILLed (host lost) stops renewing and
the server's repossessor frees the slot once the lease lapses, so a restarted run is blocked for at most
about LEASE_S plus the repossessor's 15 s loop. Leases live in the server's memory: after a server
restart a held slot stays taken for good, so a waiting run frees a slot that stayed taken ORPHAN_S with
no running run of the job. The limit is created on first use (the server no longer creates limits on
acquisition); an operator who sets it to 0 in the UI pauses the job's new runs.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal
from uuid import UUID

import httpx
from prefect import get_client, get_run_logger
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
from prefect.client.schemas.filters import (
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import ConcurrencyLeaseHolder, StateType
from prefect.concurrency.asyncio import ConcurrencySlotAcquisitionError
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists
from prefect.runtime import flow_run
from prefect.states import Failed, State

from spotrun.tasks.decisions.policy import DuplicateRuns
from spotrun.tasks.ownership import adoption
from spotrun.tasks.settings import Settings

LIMIT_PREFIX = "spotrun-job:"
RUN_KEY_TAG = "run-key:"
LEASE_S = 60.0  # the shortest lease the server accepts: a dead holder's slot comes back soonest
# A dead holder's lease lapses and is revoked within LEASE_S + 15 s; a slot still taken with no run to
# hold it after this long lost its lease (a server restart: leases live in the server's memory).
ORPHAN_S = LEASE_S + 30
POLL_S = 5.0
FLOW_NAME = "resilient-training"


@dataclass(frozen=True)
class RunningRun:
    """A running flow run of the training flow, as far as the guard needs it."""

    id: str
    name: str
    job: str
    started: datetime | None


@dataclass(frozen=True)
class Busy:
    """What a run does when its job's slot is taken, and the one line it logs (or fails with)."""

    wait: bool
    message: str


def limit_name(job: str) -> str:
    """The global concurrency limit that admits one flow run of `job` (a slot id: see `slot_id`)."""
    return f"{LIMIT_PREFIX}{job}"


def slot_id(job: str, run_key: str | None) -> str:
    """What one slot admits a run of: the job, or one run key of a keyed job (`charlm-nightly@2026-12-05`)."""
    return f"{job}@{run_key}" if run_key else job


def run_key_tag(run_key: str) -> str:
    """The tag a keyed flow run carries (tasks/retraining/run_keys.py): the guard and the UI
    tell keys apart by it."""
    return f"{RUN_KEY_TAG}{run_key}"


def holder_of(runs: list[RunningRun], job: str, me: str) -> RunningRun | None:
    """The run most likely holding the job's slot: the earliest-started other running run of the job
    (later ones are waiting, as this one is)."""
    others = [r for r in runs if r.job == job and r.id != me]
    return min(others, key=lambda r: (r.started is None, r.started or datetime.min), default=None)


def on_busy(job: str, policy: DuplicateRuns, holder: RunningRun | None, paused: bool = False) -> Busy:
    """Wait or refuse, with the line that names the run in the way."""
    if paused:
        where = f"nothing: the limit {limit_name(job)} is set to 0 (paused); raise it to 1 to run the job"
        return Busy(policy != "reject", f"job {job} waits for {where}")
    where = (
        f"flow run {holder.name} ({holder.id})"
        if holder
        else f"another flow run (no running run of it is listed: a dead holder's slot in {limit_name(job)} "
        f"comes back within {LEASE_S + 15:.0f} s)"
    )
    if policy == "reject":
        return Busy(False, f"job {job} is already running in {where}; refused (duplicate_runs: reject)")
    return Busy(True, f"job {job} is already running in {where}; waiting")


WaitAction = Literal["take", "wait", "free"]


def while_busy(
    free: bool, holder: bool, paused: bool, *, alone_since: float | None, now: float
) -> tuple[WaitAction, float | None]:
    """One look at a taken slot while waiting: take it once free; free it when it stayed taken with no
    running holder for ORPHAN_S (its lease is gone); else wait. Returns the action and since when the
    slot has been taken with no holder."""
    if free:
        return "take", None
    if holder or paused:
        return "wait", None
    since = now if alone_since is None else alone_since
    return ("free" if now - since >= ORPHAN_S else "wait"), since


@contextmanager
def job_slot(job: str, policy: DuplicateRuns, run_key: str | None = None) -> Iterator[str | None]:
    """Hold the slot of `job` (a slot id) for the block. Yields None when held, or the refusal line under
    "reject". Outside a flow run (plain `.fn()` use) there is no server to ask: a no-op."""
    me = flow_run.get_id()
    if me is None:
        yield None
        return
    name = limit_name(job)
    # Look before taking: a refused non-blocking acquire makes Prefect log an ERROR with a traceback.
    # Two runs starting within the same few milliseconds may both see the slot free; the loser then
    # waits in the acquire below even under "reject", which is still one run at a time.
    taken, limit = _occupancy(name)
    if taken >= limit:
        busy = on_busy(job, policy, holder_of(_running_runs(), job, me), paused=limit == 0)
        get_run_logger().warning(busy.message)
        if not busy.wait:
            yield busy.message
            return
        _wait_for_slot(name, job, me, Settings.from_env().job_dir(job.split("@")[0], run_key))
    with ExitStack() as held:
        _acquire(held, name, me)  # normally free now; if another waiter took it first, waits for it
        if taken >= limit:
            get_run_logger().info("job %s: the slot is free, starting", job)
        yield None


SLOT_TRIES = 6  # acquires a busy server refused (503 from a locked SQLite): 1+2+4+8+16 s of backoff
BUSY_CODES = (429, 502, 503, 504)


def server_busy(error: BaseException) -> bool:
    """Whether a refused acquire is the server being busy (worth another try), not an answer."""
    cause = error.__cause__
    if isinstance(cause, httpx.HTTPStatusError):
        return cause.response.status_code in BUSY_CODES
    return isinstance(cause, httpx.TransportError)


def _acquire(held: ExitStack, name: str, me: str) -> None:
    """Take the slot into `held`, trying again while the server answers busy: at 50 jobs on one SQLite
    server, 5 of 50 flow runs failed on a single 503 here (bench/scale.py), which Prefect's client does
    not retry for this call."""
    for attempt in range(1, SLOT_TRIES + 1):
        try:
            held.enter_context(
                concurrency(
                    name,
                    lease_duration=LEASE_S,
                    strict=True,  # a missing limit must not pass as "no limit"
                    holder=ConcurrencyLeaseHolder(type="flow_run", id=UUID(me)),
                    # training goes on when the server is briefly unreachable: the storage lease guards it
                    raise_on_lease_renewal_failure=False,
                )
            )
            return
        except ConcurrencySlotAcquisitionError as e:
            if attempt == SLOT_TRIES or not server_busy(e):
                raise
            delay = float(2 ** (attempt - 1))
            get_run_logger().warning("job slot %s: %s; trying again in %.0f s", name, e, delay)
            time.sleep(delay)


def one_run_per_job(fn: Callable[..., State]) -> Callable[..., State]:
    """Decorate a flow function taking `job` (a JobSpec) and `policy` (a RetryPolicy): its body runs
    holding the job's slot; a refused run ends Failed with the line naming the running one, before the
    body records anything."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> State:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        job, policy = bound.arguments["job"], bound.arguments["policy"]
        with job_slot(slot_id(job.name, job.run_key), policy.duplicate_runs, job.run_key) as refused:
            return Failed(message=refused) if refused else fn(*args, **kwargs)

    # Resolved types, not the strings `from __future__ import annotations` leaves: Prefect validates
    # parameters against the signature in the namespace of the function it was given, this module's.
    guarded.__signature__ = inspect.signature(fn, eval_str=True)  # type: ignore[attr-defined]
    return guarded


def _wait_for_slot(name: str, job: str, me: str, job_dir: Path) -> None:
    """Poll until the slot is free, freeing one whose holder is gone without its lease."""
    alone_since: float | None = None
    while True:
        taken, limit = _occupancy(name)
        runs = _running_runs() if taken >= limit else []
        holder = holder_of(runs, job, me) if taken >= limit else None
        action, alone_since = while_busy(
            taken < limit, holder is not None, limit == 0, alone_since=alone_since, now=time.monotonic()
        )
        if action == "take":
            return
        if holder is not None and _holder_dead_here(job_dir, runs, job, me=me, holder=holder.id):
            get_run_logger().warning(
                "job %s: the controller of flow run %s (%s) ran on this host and is gone; freeing %s now "
                "instead of waiting for its lease to lapse",
                job,
                holder.name,
                holder.id,
                name,
            )
            _free(name)
            continue
        if action == "free":
            get_run_logger().warning(
                "job %s: %s stayed taken %.0f s with no running flow run of the job (its lease was lost, "
                "e.g. by a server restart); freeing it",
                job,
                name,
                ORPHAN_S,
            )
            _free(name)
            continue
        time.sleep(POLL_S)


def _free(name: str) -> None:
    with get_client(sync_client=True) as client:
        client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(active_slots=0))


def _holder_dead_here(job_dir: Path, runs: list[RunningRun], job: str, *, me: str, holder: str) -> bool:
    """Whether the slot's holder is the job's last controller on this host and its process is gone
    (SIGKILL, OOM): its slot can never be renewed, so waiting out the lease only delays the recovery.
    Only when it is the one other running run of the job: a second one may have just taken the slot
    and not yet written its controller file."""
    if [r.id for r in runs if r.job == job and r.id != me] != [holder]:
        return False
    info = adoption.read_controller(job_dir)
    return info is not None and info.flow_run_id == holder and info.process.alive_here() is False


def _occupancy(name: str) -> tuple[int, int]:
    """(slots taken, limit) of the job's limit, created with limit 1 if missing."""
    with get_client(sync_client=True) as client:
        # an existing limit is kept as it is: an operator may have set it to 0 to pause the job
        with suppress(ObjectAlreadyExists):
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
        found = client.read_global_concurrency_limit_by_name(name)
    return found.active_slots, found.limit


def _running_runs() -> list[RunningRun]:
    # a run being cancelled still holds its slot until its process stops
    states = [StateType.RUNNING, StateType.CANCELLING]
    running = FlowRunFilterState(type=FlowRunFilterStateType(any_=states))
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=[FLOW_NAME])),
            flow_run_filter=FlowRunFilter(state=running),
        )
    return [RunningRun(str(r.id), r.name, _slot_of(r.parameters, r.tags), r.start_time) for r in runs]


def _slot_of(parameters: dict[str, Any], tags: list[str]) -> str:
    """A running run's slot id: its job's name, and its run key where it is tagged with one."""
    key = next((t.removeprefix(RUN_KEY_TAG) for t in tags if t.startswith(RUN_KEY_TAG)), None)
    return slot_id(str((parameters.get("job") or {}).get("name", "")), key)
