"""A new controller adopts a job whose controller died: same job run, the lost attempt closed, no leftovers.

The controller (the flow process) is as mortal as its workers. When it dies outright (host loss, SIGKILL)
it records nothing: its job run stays `running` and its last attempt has no row. The next flow run of
the job (started by the crashed-run automation, a schedule or a person) adopts it:

    orphan = the job's newest job run still `running`, same storage, whose controller is gone
    -> stop the worker the dead controller left (local: the pid in worker.json; EC2: that instance)
    -> close its attempt as `lost (controller died)`, with the steps the trainer reached (its heartbeat)
    -> continue the job run: attempt numbers, budgets and history go on where they stopped

"Gone" is decided by `controller_gone` (a pure function): on this host, a controller whose process no
longer exists is gone at once; elsewhere, Prefect's word that its flow run is final (Crashed by the
zombie automation) is needed. A live controller is never adopted: two controllers would double-train.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from spotrun.tasks.decisions.attempts import AttemptRecord, Outcome
from spotrun.tasks.decisions.lost_steps import kept_step, lost_steps
from spotrun.tasks.history.models import AttemptRow, JobRunRow, JobStatus
from spotrun.tasks.providers.base import Worker
from spotrun.trainer.checkpoint.catalog import read_latest
from spotrun.trainer.errors import StorageError
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.telemetry.heartbeat import read_heartbeat

log = logging.getLogger(__name__)

CONTROLLER_FILE = "controller.json"
WORKER_FILE = "worker.json"
LIVE_STATES = ("SCHEDULED", "PENDING", "RUNNING", "CANCELLING", "PAUSED")
STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class ProcessRef:
    """A process on a host, robust to pid reuse (the kernel's start time of the pid is part of it)."""

    host: str
    pid: int
    start_ticks: int | None

    @classmethod
    def of(cls, pid: int) -> ProcessRef:
        return cls(socket.gethostname(), pid, _start_ticks(pid))

    def alive_here(self) -> bool | None:
        """True/False on this host; None when the process ran elsewhere (cannot tell from here)."""
        if self.host != socket.gethostname():
            return None
        ticks = _start_ticks(self.pid)
        return ticks is not None and (self.start_ticks is None or ticks == self.start_ticks)


@dataclass(frozen=True)
class ControllerInfo:
    """Who controls a job run right now: written by each controller when it starts (or adopts)."""

    job_run_id: str
    flow_run_id: str
    process: ProcessRef
    started_at: float


@dataclass(frozen=True)
class WorkerInfo:
    """The worker a controller is watching: written at provision, removed once the attempt is recorded."""

    job_run_id: str
    flow_run_id: str
    worker_id: str
    provider: str
    attempt: int
    started_at: float
    process: ProcessRef | None  # local workers


def controller_gone(info: ControllerInfo | None, flow_state: str | None) -> bool:
    """Whether the controller of an orphan-looking job run is dead. Same host: the process decides at once.
    Elsewhere (or no file): only a final flow-run state does; an unknown state is not proof of death."""
    if info is not None:
        here = info.process.alive_here()
        if here is not None:
            return not here
    return flow_state is not None and flow_state not in LIVE_STATES


def write_controller(job_dir: Path, job_run_id: str, flow_run_id: str) -> None:
    info = ControllerInfo(job_run_id, flow_run_id, ProcessRef.of(os.getpid()), time.time())
    _write_json(job_dir / CONTROLLER_FILE, asdict(info))


def clear_controller(job_dir: Path) -> None:
    """This controller is done with the job run (it ended, recorded): nothing is left to adopt."""
    (job_dir / CONTROLLER_FILE).unlink(missing_ok=True)


def read_controller(job_dir: Path) -> ControllerInfo | None:
    d = _read_json(job_dir / CONTROLLER_FILE)
    if d is None:
        return None
    try:
        return ControllerInfo(d["job_run_id"], d["flow_run_id"], ProcessRef(**d["process"]), d["started_at"])
    except (KeyError, TypeError):
        return None


def write_worker(job_dir: Path, job_run_id: str, flow_run_id: str, worker: Worker) -> None:
    proc = getattr(worker.handle, "proc", None)
    ref = ProcessRef.of(proc.pid) if proc is not None else None
    info = WorkerInfo(
        job_run_id,
        flow_run_id,
        worker.id,
        provider=worker.provider,
        attempt=worker.attempt,
        started_at=worker.started_at,
        process=ref,
    )
    _write_json(job_dir / WORKER_FILE, asdict(info))


def clear_worker(job_dir: Path) -> None:
    (job_dir / WORKER_FILE).unlink(missing_ok=True)


def read_worker(job_dir: Path) -> WorkerInfo | None:
    d = _read_json(job_dir / WORKER_FILE)
    if d is None:
        return None
    try:
        ref = ProcessRef(**d["process"]) if d.get("process") else None
        return WorkerInfo(**{**d, "process": ref})
    except TypeError:
        return None


def stop_local_worker(ref: ProcessRef, grace_s: float = STOP_GRACE_S) -> bool:
    """SIGTERM a leftover local trainer's process group (its emergency checkpoint), SIGKILL after `grace_s`.
    False when it is not running here (gone, or on another host)."""
    if ref.alive_here() is not True:
        return False
    log.warning("stopping the trainer (pid %d) left by the dead controller", ref.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(ref.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while ref.alive_here() and time.monotonic() < deadline:
        time.sleep(0.2)
    if ref.alive_here():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(ref.pid, signal.SIGKILL)
    return True


def to_records(rows: list[AttemptRow]) -> list[AttemptRecord]:
    """The attempts of an adopted job run, as the control loop keeps them (budgets count them)."""
    names = [f.name for f in fields(AttemptRecord)]
    return [AttemptRecord(**{n: getattr(r, n) for n in names}) for r in rows]


def lost_attempt(
    worker: WorkerInfo | None,
    attempt: int,
    dead_flow_run: str,
    *,
    last_step: int,
    durable_step: int | None,
    now: float,
) -> AttemptRecord:
    """The row for the attempt the dead controller never recorded: lost, with the steps its trainer had
    reached (from the trainer's own heartbeat in storage) beyond the newest durable checkpoint."""
    started = worker.started_at if worker is not None else now
    return AttemptRecord(
        attempt=attempt,
        worker_id=worker.worker_id if worker is not None else "",
        provider=worker.provider if worker is not None else "",
        started_at=started,
        ended_at=now,
        outcome=Outcome.LOST,
        cause=f"controller died (flow run {dead_flow_run or 'unknown'}); adopted by a new flow run",
        error="controller died",
        last_step=last_step,
        last_durable_step=durable_step,
        lost_steps=lost_steps(last_step, kept_step(last_step, durable=durable_step)),
        wall_s=max(0.0, now - started),
        extra={"controller_died": True},
    )


@dataclass(frozen=True)
class Leftover:
    """The adopted job run a leftover worker belongs to."""

    job_run_id: str
    dead_flow_run: str  # the dead controller's flow run
    provider: str
    attempts: list[AttemptRecord]  # the job run's attempts so far


def close_leftover(
    job: JobSpec, left: WorkerInfo | None, swept: list[str], *, run: Leftover, warn: Callable[[str], None]
) -> tuple[str | None, AttemptRecord | None]:
    """Stop the worker a dead controller left and make its attempt's row: (its id, the row). `swept`: the
    ids the provider stopped by the dead flow run's tag (EC2, from any host), the newest last; a local
    one is stopped by its pid file. (None, None): nothing was in flight; (id, None): a controller that
    adopted it before already recorded it."""
    if left is not None and left.process is not None:
        stop_local_worker(left.process)
    worker_id = swept[-1] if swept else (left.worker_id if left is not None else None)
    if worker_id is None:
        return None, None
    if recorded_before(run.attempts, left, worker_id):
        return worker_id, None
    return worker_id, _in_flight_attempt(job, left, worker_id, run=run, warn=warn)


def _in_flight_attempt(
    job: JobSpec, left: WorkerInfo | None, worker_id: str, *, run: Leftover, warn: Callable[[str], None]
) -> AttemptRecord:
    """The row of the attempt a dead controller left in flight: lost, with the steps its trainer reached
    (its heartbeat in the job's storage) past the newest durable checkpoint."""
    try:
        storage = job.open_storage()
        durable = read_latest(storage)
        beat = read_heartbeat(storage, worker_id)
    except StorageError as e:  # the row matters more than its step counts
        warn(f"cannot read the lost attempt's progress: {e}")
        durable, beat = None, None
    last_step = max(int((beat or {}).get("last_step") or 0), durable or 0)
    now, attempt = time.time(), len(run.attempts) + 1
    if left is None:
        left = WorkerInfo(
            run.job_run_id,
            run.dead_flow_run,
            worker_id,
            provider=run.provider,
            attempt=attempt,
            started_at=now,
            process=None,
        )
    return lost_attempt(left, attempt, run.dead_flow_run, last_step=last_step, durable_step=durable, now=now)


def recorded_before(records: list[AttemptRecord], left: WorkerInfo | None, worker_id: str) -> bool:
    """Whether a controller that adopted this worker and died too already recorded it as lost (a pid may
    be reused: the start time must match as well)."""
    return any(
        r.extra.get("controller_died")
        and r.worker_id == worker_id
        and (left is None or abs(r.started_at - left.started_at) < 1e-3)
        for r in records
    )


def should_adopt(
    row: JobRunRow | None,
    storage_uri: str,
    me: str,
    *,
    recovers: str,
    info: ControllerInfo | None,
    flow_state: Callable[[], str | None],
) -> bool:
    """Whether the flow run `me` continues the job's latest job run `row`, rather than starting one.

    Yes for the run it was started to recover (`recovers`: recover-job tags the new run with the crashed
    one), `running` or already closed `crashed` by the flow's hook. Otherwise only a `running` one whose
    controller is gone: on this host its process decides (`info`, when it names this job run); elsewhere
    Prefect's word that its flow run is final (`flow_state`, asked only then)."""
    if row is None or row.storage_uri != storage_uri or (row.flow_run_id or "") == me:
        return False
    if recovers and row.flow_run_id == recovers and row.status in (JobStatus.RUNNING, JobStatus.CRASHED):
        return True
    if row.status is not JobStatus.RUNNING:
        return False
    mine = info if info is not None and info.job_run_id == row.id else None
    here = mine.process.alive_here() if mine is not None else None
    if here is not None:
        return not here
    return controller_gone(None, flow_state())


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); None if no process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        if not os.path.isdir("/proc"):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return None
            except PermissionError:
                return 0
            return 0
        return None
    try:
        after_name = stat.rsplit(")", 1)[1].split()
        return None if after_name[0] in ("Z", "X") else int(after_name[19])  # a zombie is dead
    except (IndexError, ValueError):
        return None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None
