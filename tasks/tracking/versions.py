"""What a keyed run's registered model version carries, and the alias move (the promotion gate's effect).

After the tracker registers a completed run's final weights as a version of the model named after the
job (mlflow_run.py `register`), `finish_version` logs the evaluation the trainer wrote to COMPLETED.json
to the MLflow run, tags the version with its run key, job run and lineage (the warm start's source),
writes the lineage into the version's description, and, with `promote`, decides (tasks/decisions/promotion.py)
and points the alias at the version when it wins. Every write is idempotent (a tag marks the metrics as
logged; tags, description and alias are set to the same values again), so a controller that dies and is
replaced repeats it harmlessly.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from spotrun.tasks.decisions.promotion import PromotionDecision, decide_from_eval
from spotrun.tasks.tracking.mlflow_run import MlflowRun, import_mlflow
from spotrun.trainer.checkpoint.completion import completed_eval
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import Storage

log = logging.getLogger(__name__)

EVAL_TAG = "spotrun.eval_logged"  # on the run: its evaluation metrics were sent (once)
CHAMPION_PREFIX = "champion/"  # the alias holder's figures on the same data, beside the run's own
DESCRIPTION_MAX_CHARS = 5000


def lineage_tags(job: JobSpec) -> dict[str, str]:
    """The run key and where the run's weights started from, as MLflow tags (run and version)."""
    tags: dict[str, str] = {}
    if job.run_key and job.resolved:
        tags["spotrun.run_key"] = job.run_key
    w = job.init_from
    if w is not None:
        src = w.source
        tags["spotrun.init_from"] = (
            f"{src.job}/{src.run_key or src.job_run_id or '-'}@{src.step}" if src else "none: fresh start"
        )
        tags["spotrun.init_from.parts"] = ",".join(w.parts)
        if src is not None and src.version:
            tags["spotrun.init_from.version"] = src.version
    return tags


def description(job: JobSpec, job_run_id: str, decision: PromotionDecision | None) -> str:
    """The version's description: which run made it, from what it started, what the gate said."""
    what = f"run key {job.run_key} of {job.name}" if job.run_key and job.resolved else f"job {job.name}"
    lines = [f"{what} (job run {job_run_id})"]
    w = job.init_from
    if w is not None and w.source is not None:
        s = w.source
        version = f", version {s.version}" if s.version else ""
        lines.append(
            f"warm start: {' and '.join(w.parts)} from {s.job} {s.run_key or s.job_run_id} "
            f"step {s.step}{version} ({s.storage})"
        )
    elif w is not None:
        lines.append(f"warm start: none ({w.which} of {w.job} had no completed run): a fresh start")
    if decision is not None:
        lines.append(f"promotion: {decision.reason}")
    return "\n".join(lines)[:DESCRIPTION_MAX_CHARS]


def log_eval(run: MlflowRun, block: dict[str, Any] | None, step: int) -> int:
    """The evaluation's metrics at the final step (the champion's prefixed `champion/`), once; returns
    how many were sent."""
    if block is None or run.tags.get(EVAL_TAG):
        return 0
    mlflow = import_mlflow()
    ms = int(time.time() * 1000)
    pairs = list(_numbers(block.get("metrics")).items())
    champion = block.get("champion")
    if isinstance(champion, dict):
        pairs += [(CHAMPION_PREFIX + k, v) for k, v in _numbers(champion.get("metrics")).items()]
    metrics = [mlflow.entities.Metric(k, v, ms, step) for k, v in pairs]
    mark = mlflow.entities.RunTag(EVAL_TAG, str(len(metrics)))
    run.client.log_batch(run.ref.run_id, metrics=metrics, tags=[mark])  # the mark in the same call
    run.tags[EVAL_TAG] = str(len(metrics))
    return len(metrics)


def _numbers(v: Any) -> dict[str, float]:
    if not isinstance(v, dict):
        return {}
    out = {}
    for k, x in v.items():
        if isinstance(x, int | float) and not isinstance(x, bool):
            out[str(k)] = float(x)  # NaN and inf too: MLflow stores them, and they explain a "kept"
    return out


def finish_version(
    run: MlflowRun, job: JobSpec, job_run_id: str, *, model: str | None, storage: Storage, step: int
) -> PromotionDecision | None:
    """Log the evaluation, decide the promotion (with `job.promote`), move the alias when it wins, and
    tag and describe the version `model` ("name/version"; None: none was registered)."""
    block = completed_eval(storage)
    sent = log_eval(run, block, step)
    if sent:
        log.info("evaluation of %s: %d metric(s) sent to MLflow", job.name, sent)
    decision = decide_from_eval(job.promote, block) if job.promote is not None else None
    if model is None:
        return decision
    name, _, version = model.rpartition("/")
    moved = False
    if decision is not None and decision.promoted:
        run.client.set_registered_model_alias(name, decision.alias, version)
        moved = True
        log.info("model %s version %s is now %r: %s", name, version, decision.alias, decision.reason)
    elif decision is not None:
        log.info("model %s version %s not promoted: %s", name, version, decision.reason)
    tags = lineage_tags(job) | {"spotrun.job_run_id": job_run_id}
    if decision is not None:
        tags["spotrun.promotion"] = "promoted" if decision.promoted else "kept"
    for key, value in tags.items():
        run.client.set_model_version_tag(name, version, key, value)
    run.client.update_model_version(name, version, description=description(job, job_run_id, decision))
    return decision.registered(name, version, moved) if decision is not None else None
