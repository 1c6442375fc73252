"""Every history write as data: an operation name and a JSON payload, applied by a registered function.

A write that cannot reach the database is kept as an `Op` in the journal and applied later, maybe by
another process, maybe twice (it may have landed before the connection broke). So each function takes
`replay`: when True the write may already be there and must not be doubled (inserts skip what exists,
updates set absolute values); when False it is a first try and a duplicate is the caller's error.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import exists, select, update
from sqlalchemy.orm import Session

from spotrun.tasks.history.models import Alert, Attempt, CheckpointRejection, JobRun, JobStatus

Apply = Callable[[Session, dict[str, Any], bool], None]
OPS: dict[str, Apply] = {}


@dataclass(frozen=True)
class Op:
    """One write: `name` selects the function in OPS, `args` is its JSON payload."""

    name: str
    args: dict[str, Any]
    what: str  # for logs: "attempt 3 of job run 1f0c…"

    def to_json(self) -> str:
        return json.dumps({"op": self.name, "args": self.args, "what": self.what}, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Op:
        """Parse one journal line; ValueError when it is not a known operation."""
        d = json.loads(line)
        if not isinstance(d, dict) or d.get("op") not in OPS or not isinstance(d.get("args"), dict):
            raise ValueError(f"not a history operation: {line[:80]!r}")
        return cls(d["op"], d["args"], str(d.get("what", d["op"])))

    def apply(self, s: Session, replay: bool) -> None:
        OPS[self.name](s, self.args, replay)


def _op(name: str) -> Callable[[Apply], Apply]:
    def register(fn: Apply) -> Apply:
        OPS[name] = fn
        return fn

    return register


def stamp(t: datetime) -> str:
    """A datetime for a payload (ISO 8601 keeps the zone and every microsecond)."""
    return t.isoformat()


def _when(s: str) -> datetime:
    return datetime.fromisoformat(s)


@_op("start_job_run")
def _start_job_run(s: Session, a: dict[str, Any], replay: bool) -> None:
    if s.get(JobRun, a["id"]) is not None:  # ids are fresh UUIDs: one already there is this one
        return
    s.add(JobRun(**(a | {"started_at": _when(a["started_at"]), "ended_at": None})))


@_op("record_attempt")
def _record_attempt(s: Session, a: dict[str, Any], replay: bool) -> None:
    run_id, values = a["job_run_id"], dict(a["record"])
    if replay and s.scalar(
        select(exists().where(Attempt.job_run_id == run_id, Attempt.attempt == values["attempt"]))
    ):
        return
    job = a.get("job") or s.scalar(select(JobRun.job).where(JobRun.id == run_id))
    if job is None:
        raise LookupError(f"no job run {run_id}")
    values["started_at"] = _when(values["started_at"])
    values["ended_at"] = _when(values["ended_at"])
    s.add(Attempt(job_run_id=run_id, job=job, **values))


@_op("record_rejections")
def _record_rejections(s: Session, a: dict[str, Any], replay: bool) -> None:
    run_id, attempt, created_at = a["job_run_id"], int(a["attempt"]), _when(a["created_at"])
    for step, reasons in a["rows"]:
        if replay and s.scalar(
            select(
                exists().where(
                    CheckpointRejection.job_run_id == run_id,
                    CheckpointRejection.attempt == attempt,
                    CheckpointRejection.step == step,
                )
            )
        ):
            continue
        s.add(
            CheckpointRejection(
                job_run_id=run_id, attempt=attempt, step=step, reasons=reasons, created_at=created_at
            )
        )


@_op("finish_job_run")
def _finish_job_run(s: Session, a: dict[str, Any], replay: bool) -> None:
    done = s.execute(
        update(JobRun)
        .where(JobRun.id == a["job_run_id"])
        .values(status=a["status"], message=a["message"], ended_at=_when(a["ended_at"]))
    )
    if done.rowcount == 0:  # type: ignore[attr-defined]
        raise LookupError(f"no job run {a['job_run_id']}")


@_op("adopt_job_run")
def _adopt_job_run(s: Session, a: dict[str, Any], replay: bool) -> None:
    run_id, flow_run_id = a["job_run_id"], a["flow_run_id"]
    q = update(JobRun).where(JobRun.id == run_id)
    if replay:  # adopted already when it names this flow run: count each adoption once
        q = q.where(JobRun.flow_run_id.is_distinct_from(flow_run_id))
    # running again: a run the crashed hook (or the give-up path) closed as crashed is continued too
    values = dict(status=JobStatus.RUNNING.value, ended_at=None, message="")
    done = s.execute(
        q.values(flow_run_id=flow_run_id, controller_restarts=JobRun.controller_restarts + 1, **values)
    )
    if done.rowcount == 0 and s.get(JobRun, run_id) is None:  # type: ignore[attr-defined]
        raise LookupError(f"no job run {run_id}")


@_op("record_alert")
def _record_alert(s: Session, a: dict[str, Any], replay: bool) -> None:
    values = a | {"created_at": _when(a["created_at"])}
    if replay and s.scalar(
        select(
            exists().where(
                Alert.dedup_key == values["dedup_key"],
                Alert.status == values["status"],
                Alert.created_at == values["created_at"],
            )
        )
    ):
        return
    s.add(Alert(**values))
