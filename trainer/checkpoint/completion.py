"""COMPLETED.json: the marker that says a job finished, at which step, with which spec and evaluation.

Written by the trainer at the last step (`mark_completed`); read by the trainer (a finished job does not
train again), by the controller's integrity check and run log, by the promotion gate and by retention
(a keyed run's age is its completion). Signed where a key is set, like every marker.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from spotrun.trainer.checkpoint.catalog import read_marker, read_marker_step, write_marker
from spotrun.trainer.checkpoint.format import COMPLETED
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.spec.job import JobSpec, spec_changes
from spotrun.trainer.storage import Storage

log = logging.getLogger(__name__)


def completed_step(storage: Storage) -> int | None:
    """The step COMPLETED.json records, if the job has finished."""
    return read_marker_step(storage, COMPLETED)


def completed_for(storage: Storage, spec: JobSpec) -> int | None:
    """The step at which `spec`'s job finished in `storage`, or None when it has not reached
    `spec.total_steps` there (a raised total_steps trains on, and its resume checks the model).
    ConfigError when the storage holds another finished job: another name, recipe, args, seed,
    batch size or amp (a marker written before it recorded the spec is trusted)."""
    found = read_marker(storage, COMPLETED)
    if found is None or found[0] < spec.total_steps:
        return None
    step, marker = found
    old = marker.get("spec")
    if isinstance(old, dict):
        changes = [str(c) for c in spec_changes(old, spec.model_dump(mode="json"))]
        if old.get("name") != spec.name:
            changes.insert(0, f"name {old.get('name')} -> {spec.name}")
        if changes:
            raise ConfigError(
                f"{storage.uri} holds job {old.get('name')} completed at step {step} with other settings "
                f"({', '.join(changes)}); give this job a storage of its own, or restore those settings"
            )
    return step


def mark_completed(
    storage: Storage, spec: JobSpec, step: int, evaluation: dict[str, Any] | None = None
) -> None:
    """Write COMPLETED.json (signed where a key is set),
    with the `eval` block of trainer/session/evaluation.py."""
    body = {
        "job": spec.name,
        "step": step,
        "spec_hash": spec.spec_hash(),
        "finished_at": time.time(),
        "spec": spec.public_dump(),  # what completed_for compares a later run against
    }
    if evaluation is not None:
        body["eval"] = evaluation
    write_marker(storage, COMPLETED, body)
    log.info("job %s completed at step %d", spec.name, step)


def completed_eval(storage: Storage) -> dict[str, Any] | None:
    """The `eval` block of a COMPLETED.json that validates here (signed, where a key is set); None when
    the job has not completed, the marker cannot be trusted, or it holds no evaluation."""
    found = read_marker(storage, COMPLETED)
    block = found[1].get("eval") if found is not None else None
    return block if isinstance(block, dict) else None
