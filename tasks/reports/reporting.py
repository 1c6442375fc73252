"""Prefect-native output of a job run: events for every attempt, and artifacts on the flow run."""

from __future__ import annotations

import base64
import json
import logging
from typing import Any, cast
from uuid import UUID

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate
from prefect.events import emit_event

from spotrun.tasks.decisions.attempts import AttemptRecord, Outcome
from spotrun.tasks.reports import goodput
from spotrun.tasks.reports.goodput import GoodputReport

log = logging.getLogger(__name__)

# The alert automation (deployments/) listens to these names; keep them stable.
ATTEMPT_STARTED = "spotrun.attempt.started"
ATTEMPT_PREEMPTED = "spotrun.attempt.preempted"
ATTEMPT_FAILED = "spotrun.attempt.failed"
ATTEMPT_HUNG = "spotrun.attempt.hung"  # the progress watchdog killed the worker (tasks/control/watchdog.py)
ATTEMPT_ROLLED_BACK = "spotrun.attempt.rolled-back"  # a loss spike: back to the checkpoint before it
JOB_RESTARTED = "spotrun.job.restarted"
JOB_COMPLETED = "spotrun.job.completed"
JOB_GAVE_UP = "spotrun.job.gave-up"
RESUME_CHECKED = "spotrun.attempt.resume-checked"
VERDICT_LABEL = "spotrun.resume.verdict"  # on the event's resource: `mismatch` is what an alert matches
MODEL_PROMOTION = "spotrun.model.promotion"  # a keyed run's promotion decision (tasks/decisions/promotion.py)


# A resource label on JOB_COMPLETED: "true" when the job restarted on the way, so the recovery
# automation matches only those completions.
RESTARTED_LABEL = "spotrun.restarted"


def job_resource(job: str, **labels: str) -> dict[str, str]:
    return {"prefect.resource.id": f"spotrun.job.{job}", "prefect.resource.name": job, **labels}


def emit(event: str, job: str, **payload: Any) -> None:
    """Emit a spotrun event about `job`; the run context (flow run, task run) is attached by Prefect."""
    emit_labeled(event, job, {}, payload)


def emit_labeled(event: str, job: str, labels: dict[str, str], payload: dict[str, Any]) -> None:
    """`emit` with extra labels on the job's resource, which automations can match on."""
    emit_event(event=event, resource=job_resource(job, **labels), payload={"job": job, **payload})


def attempt_event(record: AttemptRecord) -> str:
    if record.outcome is Outcome.HUNG:
        return ATTEMPT_HUNG
    if record.outcome is Outcome.ROLLED_BACK:
        return ATTEMPT_ROLLED_BACK
    return ATTEMPT_PREEMPTED if record.outcome is Outcome.PREEMPTED else ATTEMPT_FAILED


def artifact_key(job: str, what: str) -> str:
    """Artifact keys allow only lowercase letters, digits and dashes."""
    cleaned = "".join(c if c.isalnum() else "-" for c in job.lower()).strip("-")
    return f"{cleaned}-{what}"


def new_progress(job: str) -> UUID:
    # sync_compatible: a UUID in a sync flow, a coroutine only in async code
    created = create_progress_artifact(
        0.0, key=artifact_key(job, "progress"), description=f"progress of {job}"
    )
    return cast(UUID, created)


def set_progress(artifact_id: UUID, step: int, total: int) -> None:
    update_progress_artifact(artifact_id, min(100.0, 100.0 * step / max(total, 1)))


def attempts_table(job: str, records: list[AttemptRecord], artifact_id: UUID | None = None) -> UUID:
    """The attempts so far as one table artifact: created on the first call, then updated in place (the
    flow run's Artifacts tab shows one card, not one per attempt as a new version each time would)."""
    rows = [
        {
            "attempt": r.attempt,
            "worker": r.worker_id,
            "outcome": r.outcome.value,
            "cause": r.cause,
            "resumed from": "scratch" if r.resumed_from is None else r.resumed_from,
            "last step": r.last_step,
            "durable": r.last_durable_step,
            "lost steps": r.lost_steps,
            "wall s": round(r.wall_s, 1),
            "productive s": round(r.productive_s, 1),
        }
        for r in records
    ]
    if artifact_id is not None:
        with get_client(sync_client=True) as client:
            client.update_artifact(artifact_id, ArtifactUpdate(data=json.dumps(rows)))
        return artifact_id
    created = create_table_artifact(rows, key=artifact_key(job, "attempts"), description=f"attempts of {job}")
    return cast(UUID, created)


def summary_markdown(
    job: str,
    status: str,
    records: list[AttemptRecord],
    *,
    rep: GoodputReport,
    timeline: str,
    timeline_png: bytes | None = None,
) -> str:
    """The run summary: the goodput report (`spotrun report`'s figures, tasks/reports/goodput.py), the
    attempts and, with `timeline_png`, the timeline inline as a data URI, which the Prefect UI renders (a link
    to a file on the controller's disk opens nothing there)."""
    lines = [
        f"# {job}: {status}",
        "",
        "| figure | value |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in goodput.summary_rows(rep)),
        "",
        f"- timeline: below; saved at `{timeline}`" if timeline else "- timeline: not saved",
        *interval_lines(records),
        *(f"- note: {n}" for n in rep.notes if not n.startswith("GPUs per worker")),
        "",
        "| attempt | outcome | cause | resumed from | lost steps |",
        "|---|---|---|---|---|",
    ]
    for r in records:
        frm = r.resumed_checkpoint or "scratch"
        lines.append(f"| {r.attempt} | {r.outcome.value} | {r.cause} | {frm} | {r.lost_steps} |")
    if timeline_png:
        inline = base64.b64encode(timeline_png).decode("ascii")
        lines += ["", "## Timeline", "", f"![training step over wall time](data:image/png;base64,{inline})"]
    return "\n".join(lines)


def checkpoint_interval(records: list[AttemptRecord]) -> dict[str, Any] | None:
    """The interval `checkpoint.every: auto` settled on in the newest attempt that chose one."""
    chosen = [r.extra["checkpoint_interval"] for r in records if "checkpoint_interval" in r.extra]
    return dict(chosen[-1]) if chosen else None


def interval_lines(records: list[AttemptRecord]) -> list[str]:
    iv = checkpoint_interval(records)
    return [f"- checkpoint interval (every: auto): {iv['reason']}"] if iv is not None else []


def publish_summary(job: str, markdown: str) -> None:
    create_markdown_artifact(markdown, key=artifact_key(job, "summary"), description=f"run summary of {job}")
