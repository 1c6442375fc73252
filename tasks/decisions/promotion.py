"""The promotion gate: does a keyed run's new model take the alias from the model that holds it?

The trainer evaluates both models at completion on this run's (tonight's) evaluation data and writes the
figures to COMPLETED.json's `eval` block; the decision here compares them by the job's `promote` rule
(trainer/spec/runs.py Promotion). It is pure, and the same with MLflow on or off: the tracker
(tasks/tracking) moves the MLflow alias when it says so; without MLflow the decision is still recorded
(SQL's `promotion`, the summary, the event), and `init_from: {which: best}` follows it.

No Prefect and no MLflow here: the event's name lives in tasks/reports/reporting.py, the alias move in
tasks/tracking/mlflow_run.py.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from spotrun.trainer.checkpoint.completion import completed_eval
from spotrun.trainer.errors import ConfigError, StorageError
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.spec.runs import Promotion
from spotrun.trainer.storage import Storage

log = logging.getLogger(__name__)

PROMOTION_LABEL = "spotrun.promotion"  # on the event's job resource: an automation matches on it
PROMOTED, KEPT = "promoted", "kept"  # its values
_FLOAT_TOL = 1e-9  # relative: 1.25 - 1.15 must count as a margin of 0.1


@dataclass(frozen=True)
class PromotionDecision:
    """What the gate decided for one run's new model; `as_dict` is what SQL, the summary and the event
    carry (`promoted` and `version` are read back by tasks/retraining/run_keys.py's `which: best`)."""

    promoted: bool
    reason: str  # one line: the two values and why
    metric: str
    mode: str  # min | max
    alias: str
    better_by: float
    challenger: float | None  # this run's value of `metric` (None: it has none)
    champion: float | None  # the alias holder's value on the same data (None: none, or not evaluated)
    champion_version: str | None = None  # the model version the alias held
    champion_run: str | None = None  # the run key (or job run) the alias held
    model: str | None = None  # the registered model's name, once the tracker registered this run's
    version: str | None = None  # this run's model version (None: not registered, or MLflow off)
    alias_moved: bool = False  # the tracker pointed the MLflow alias at `version`

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PromotionDecision:
        """Back from `as_dict` (TrackingInfo.promotion, SQL's promotion column); unknown keys ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def registered(self, model: str, version: str, alias_moved: bool) -> PromotionDecision:
        """The decision once the tracker registered this run's version (and moved the alias or not)."""
        return replace(self, model=model, version=version, alias_moved=alias_moved)


def decide_promotion(
    rule: Promotion,
    challenger: Mapping[str, Any] | None,
    champion: Mapping[str, Any] | None,
    *,
    champion_held: bool | None = None,
    challenger_note: str = "",
    champion_note: str = "",
) -> PromotionDecision:
    """Promote the new model or keep the alias where it is (pure).

    `challenger`, `champion`: the metrics `evaluate()` returned for the new model and for the alias holder
    on this run's data. `champion_held`: whether a model held the alias at all (default: the rule names a
    champion); the notes say why metrics are missing.

    - No model holds the alias: promote (the first version).
    - The new model has no finite value of `metric` (no evaluation, the recipe returns other names, NaN):
      keep. Never promote a model nobody measured.
    - The champion held the alias but has no finite value on this data (its checkpoint could not be
      loaded or was pruned, its evaluation failed or returned NaN): promote on the new model's own figure,
      and say so. Keeping would pin the alias to a model that cannot be measured any more, and every later
      night would be kept too; the message tells people the comparison did not happen.
    - Otherwise promote when the new value beats the champion's (lower for min, higher for max) by more
      than nothing and by at least `better_by`; a tie keeps.
    """
    held = rule.champion is not None if champion_held is None else champion_held
    base = PromotionDecision(
        False,
        "",
        rule.metric,
        mode=rule.mode,
        alias=rule.alias,
        better_by=rule.better_by,
        challenger=None,
        champion=None,
    )
    if rule.champion is not None:
        base = replace(base, champion_version=rule.champion.version, champion_run=_run_of(rule))
    new, why_new = _value(challenger, rule.metric, challenger_note)
    if new is None:
        return replace(base, reason=f"kept: the new model has no {rule.metric} ({why_new})")
    base = replace(base, challenger=new)
    if not held:
        first = f"promoted: first version, no model held {rule.alias!r}; {rule.metric} {new:.6g}"
        return replace(base, promoted=True, reason=first)
    old, why_old = _value(champion, rule.metric, champion_note)
    holder = _holder(base)
    if old is None:
        return replace(
            base,
            promoted=True,
            reason=f"promoted without a comparison: {holder} could not be "
            f"evaluated ({why_old}); {rule.metric} {new:.6g}",
        )
    base = replace(base, champion=old)
    gain = old - new if rule.mode == "min" else new - old
    wins = gain > 0 and (gain >= rule.better_by or math.isclose(gain, rule.better_by, rel_tol=_FLOAT_TOL))
    cmp = "<" if new < old else ">" if new > old else "="
    figures = f"{rule.metric} {new:.6g} {cmp} {old:.6g} ({holder}; {rule.mode}"
    figures += f", better by >= {rule.better_by:g})" if rule.better_by else ")"
    if wins:
        return replace(base, promoted=True, reason=f"promoted: {figures}")
    return replace(base, reason=f"kept: {figures}")


def _value(metrics: Mapping[str, Any] | None, name: str, note: str) -> tuple[float | None, str]:
    """The finite value of `name` in `metrics`, or None and why not."""
    if metrics is None:
        return None, note or "no evaluation"
    raw = metrics.get(name)
    if raw is None:
        names = ", ".join(sorted(str(k) for k in metrics)[:8]) or "nothing"
        return None, f"evaluate() returned {names}; set promote.metric to one of them"
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return None, f"{name} is {raw!r}, not a number"
    if not math.isfinite(value):
        return None, f"{name} is {value}"
    return value, ""


def _run_of(rule: Promotion) -> str | None:
    c = rule.champion
    return (c.run_key or c.job_run_id or None) if c is not None else None


def _holder(d: PromotionDecision) -> str:
    """'champion v3 of 2026-12-04': the model that held the alias, as people know it."""
    text = f"{d.alias} v{d.champion_version}" if d.champion_version else d.alias
    return f"{text} of {d.champion_run}" if d.champion_run else text


# -- from the trainer's evaluation ------------------------------------------------------------------


def decide_from_eval(rule: Promotion, block: dict[str, Any] | None) -> PromotionDecision:
    """The decision from what the trainer evaluated (trainer.checkpoint.completion.completed_eval)."""
    if block is None:
        return decide_promotion(rule, None, None, challenger_note="COMPLETED.json has no evaluation")
    skipped = str(block.get("skipped") or "")
    metrics = _mapping(block.get("metrics"))
    champ = _mapping(block.get("champion"))
    champ_metrics = _mapping(champ.get("metrics")) if champ else None
    held = rule.champion is not None or bool(champ)
    decision = decide_promotion(
        rule,
        None if skipped else metrics,
        champ_metrics or None,
        champion_held=held,
        challenger_note=f"evaluation skipped: {skipped}" if skipped else "",
        champion_note=str(champ.get("reason") or "") if champ else "",
    )
    if champ and decision.champion_version is None and champ.get("version"):
        decision = replace(decision, champion_version=str(champ["version"]))
    if champ and decision.champion_run is None and champ.get("run_key"):
        decision = replace(decision, champion_run=str(champ["run_key"]))
    return decision


def _mapping(v: Any) -> dict[str, Any]:
    return dict(v) if isinstance(v, Mapping) else {}


def promotion_for(job: JobSpec, storage: Storage | None = None) -> PromotionDecision | None:
    """The gate's decision for a completed run of `job` (a resolved spec), read from its storage; None
    when the job has no `promote`. For a run not tracked in MLflow (no alias to move); the tracker makes
    the same decision itself and moves the alias. A storage that cannot be read decides "kept"."""
    if job.promote is None:
        return None
    try:
        block = completed_eval(storage or job.open_storage(create=False))
    except (StorageError, ConfigError, OSError) as e:  # a missing directory, an S3 outage: "kept"
        log.warning("evaluation of %s not read from %s: %s", job.name, job.storage, e)
        return decide_promotion(job.promote, None, None, challenger_note=f"COMPLETED.json not read: {e}")
    return decide_from_eval(job.promote, block)


def event_payload(
    decision: PromotionDecision, *, run_key: str | None, job_run_id: str, flow_run_id: str = ""
) -> tuple[dict[str, Any], dict[str, str]]:
    """The `spotrun.model.promotion` event's payload and resource labels (tasks/reports/reporting.py):
    `sink.event(MODEL_PROMOTION, job.name, *event_payload(...))`."""
    run = {"run_key": run_key or "", "job_run_id": job_run_id, "flow_run_id": flow_run_id}
    payload = decision.as_dict() | run
    return payload, {PROMOTION_LABEL: PROMOTED if decision.promoted else KEPT}
