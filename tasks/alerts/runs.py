"""What the alerts about scheduled retraining say: a promotion decision, a scheduled run not finished by
its deadline, a training run that ended Failed (pure; message.py lays them out for Slack and Markdown).

Each returns plain text; message.py escapes and bounds it like every other alert's.
"""

from __future__ import annotations

from dataclasses import dataclass

from spotrun.tasks.alerts.text import clip, human_duration, one_line

JOB_IN_TITLE_MAX_CHARS = 60
REASON_MAX_CHARS = 320
TERMINAL_STATES = frozenset({"Completed", "Failed", "Cancelled", "Crashed"})  # Prefect state names


@dataclass(frozen=True, kw_only=True)
class PromotionFacts:
    """A promotion decision, as the `spotrun.model.promotion` event carries it
    (tasks/decisions/promotion.py)."""

    promoted: bool = False
    reason: str = ""  # the decision's one line, with both values
    metric: str = ""
    mode: str = ""  # min | max
    alias: str = ""
    better_by: float = 0.0
    challenger: float | None = None  # the new model's value
    champion: float | None = None  # the alias holder's value on the same data
    champion_version: str | None = None
    champion_run: str | None = None
    model: str | None = None
    version: str | None = None  # the new model's version
    alias_moved: bool = False
    run_key: str = ""
    job_run_id: str = ""


def _job(job: str) -> str:
    return clip(job, JOB_IN_TITLE_MAX_CHARS)


def _value(v: float | None) -> str:
    return "none" if v is None else f"{v:.6g}"


def promotion_title(job: str, p: PromotionFacts) -> str:
    """'spotrun: nightly 2026-12-05: v4 promoted to champion' or '... champion v3 kept'."""
    run = f" {clip(p.run_key, 40)}" if p.run_key else ""
    alias = p.alias or "the alias"
    if p.promoted:
        new = f"v{p.version}" if p.version else "the new model"
        where = "" if p.alias_moved or not p.version else " (alias not moved: see the run's log)"
        return f"spotrun: {_job(job)}{run}: {new} promoted to {alias}{where}"
    held = f" v{p.champion_version}" if p.champion_version else ""
    return f"spotrun: {_job(job)}{run}: {alias}{held} kept"


def promotion_facts(job: str, p: PromotionFacts) -> list[tuple[str, str]]:
    """The decision's fields: both values, the rule, the versions."""
    facts = [("Job", job), ("Run key", p.run_key or "none (unkeyed job)")]
    facts.append(("Decision", "promoted" if p.promoted else "kept"))
    rule = f"{p.metric or '?'} ({'lower' if p.mode == 'min' else 'higher'} is better"
    rule += f", by at least {p.better_by:g})" if p.better_by else ")"
    facts.append(("Rule", rule))
    facts.append(("New model", f"{_value(p.challenger)}" + (f" (v{p.version})" if p.version else "")))
    holder = f"v{p.champion_version}" if p.champion_version else ""
    holder += f"{' of ' if holder else ''}{p.champion_run}" if p.champion_run else ""
    facts.append(("Champion", _value(p.champion) + (f" ({holder})" if holder else "")))
    facts.append(("Why", clip(one_line(p.reason), REASON_MAX_CHARS) or "not known"))
    return facts


def missed_title(job: str, slot: str, deadline_s: float) -> str:
    """'spotrun: nightly: the run for 2026-12-05 03:00:00+00:00 has not finished 1 d after its slot'."""
    which = f"the run for {clip(slot, 40)}" if slot else "a scheduled run"
    return f"spotrun: {_job(job)}: {which} has not finished {human_duration(deadline_s)} after its slot"


def missed_facts(job: str, slot: str, deadline_s: float, state: str) -> list[tuple[str, str]]:
    """A slot without a finished run: when, how long it had, where it is, what to look at."""
    hint = {
        "Late": "no worker took it: start the worker (`spotrun serve`) or check its pool and queue",
        "Scheduled": "no worker took it: start the worker (`spotrun serve`) or check its pool and queue",
        "Pending": "a worker took it but the flow never started: see the worker's log",
        "Running": "still training: see the flow run (a long queue, a slow night, a stuck step)",
        "Paused": "paused: resume or cancel it",
    }.get(state, "see the flow run")
    return [
        ("Job", job),
        ("Slot", slot or "not known"),
        ("Deadline", f"{human_duration(deadline_s)} after the slot"),
        ("State", state or "not known"),
        ("Look at", hint),
    ]


def failed_title(job: str) -> str:
    return f"spotrun: {_job(job)}: a training run ended Failed"


def failed_facts(job: str, message: str) -> list[tuple[str, str]]:
    """A failed run: its state message (a refusal's one line, a give-up's reason, an error)."""
    return [("Job", job), ("Message", clip(one_line(message), REASON_MAX_CHARS) or "none")]
