"""The per-step metrics the trainers published to the job's storage
(trainer/telemetry/metrics_log.py), read back.

Each object `metrics/step_<S>.jsonl` holds the steps up to the checkpoint step S that the object before
it did not; it is written before that checkpoint's manifest. Only steps up to the newest committed
checkpoint are sent (`committed_step`): an object whose checkpoint never committed is deleted by the next
attempt, which trains those steps again. Reading is ordered by S; a step found twice (a checkpoint
rejected after its metrics were sent, then recomputed by the next attempt) counts once, from the first
object that has it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from spotrun.trainer.checkpoint.catalog import list_checkpoints
from spotrun.trainer.storage import Storage, get_bytes
from spotrun.trainer.telemetry.metrics_log import PREFIX, parse_metrics_key

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepMetrics:
    step: int
    t: float  # epoch seconds
    loss: float
    lr: float | None = None
    steps_per_s: float | None = None
    lr_next: float | None = None  # the object's last step only: the rate set for the step after it
    metrics: dict[str, float] = field(default_factory=dict)  # the loop's own (s.step_done(loss, **metrics))


def parse_line(line: str) -> StepMetrics | None:
    """One line of a metrics object; None when it is not one (a torn or foreign line)."""
    try:
        d = json.loads(line)
        return StepMetrics(
            step=int(d["step"]),
            t=float(d.get("t") or 0.0),
            loss=float.fromhex(d["loss"]),
            lr=float.fromhex(d["lr"]) if "lr" in d else None,
            steps_per_s=float(d["sps"]) if "sps" in d else None,
            lr_next=float.fromhex(d["lr_next"]) if "lr_next" in d else None,
            metrics={str(k): float.fromhex(v) for k, v in (d.get("m") or {}).items()},
        )
    except (ValueError, KeyError, TypeError):
        return None


def metric_objects(storage: Storage) -> list[tuple[int, str]]:
    """(durable step, key) of every metrics object, oldest step first."""
    found = [(s, o.key) for o in storage.list(PREFIX) if (s := parse_metrics_key(o.key)) is not None]
    return sorted(found)


def read_steps(
    storage: Storage,
    after: int = 0,
    through: int | None = None,
    *,
    objects: list[tuple[int, str]] | None = None,
) -> dict[int, StepMetrics]:
    """The published steps in (after, through], by step. Objects wholly at or before `after` are not read;
    neither is any after the first one that reaches `through`. `objects`: `metric_objects(storage)`, when
    the caller listed them already."""
    out: dict[int, StepMetrics] = {}
    for durable, key in metric_objects(storage) if objects is None else objects:
        if durable <= after:
            continue
        try:
            text = get_bytes(storage, key).decode()
        except FileNotFoundError:  # deleted since the listing
            continue
        for line in text.splitlines():
            m = parse_line(line)
            if m is None:
                log.warning("skipping an unreadable line in %s/%s", storage.uri, key)
                continue
            if m.step > after and (through is None or m.step <= through):
                out.setdefault(m.step, m)
        if through is not None and durable >= through:
            break
    return out


def committed_step(storage: Storage) -> int | None:
    """The newest step with a committed checkpoint (a manifest) in the job's storage: the metrics up to
    it are final. Read from the listing, not `latest`, which a trainer killed after the manifest never
    moved."""
    return max((s for s, c in list_checkpoints(storage).items() if c.committed), default=None)
