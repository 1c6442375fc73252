"""Goodput of one job run, computed from its attempt rows alone (what SQL stores; no Prefect, no I/O).

Definitions (docs/architecture.md's goodput report section states the same):

- wall time: the first attempt's start to the job run's end; while it runs, to now; a job run that
  ended without an end time (its controller died): to the last attempt's end.
- a step counts when it was not lost. Steps past an attempt's last durable checkpoint are lost when
  the attempt did not complete. When the next attempt resumed from an earlier step (the validator
  refused the newer checkpoint), the steps past that resume point were lost as well: they were redone.
  When it resumed from a later step (a checkpoint this attempt wrote but did not live to report), the
  steps up to it were kept. One rule, tasks/decisions/lost_steps.py, which the attempts table follows too.
- ETT (effective training time): the wall time of the steps that count, summed over attempts: the
  steps kept times the attempt's seconds per step. For an attempt whose durable step is the one kept
  this is exactly its stored `productive_s` (training start to the moment that step was reached).
- goodput = ETT / wall time.
- seconds per step of an attempt: `productive_s / (durable step - resume step)`; for an attempt with
  no durable progress, the same ratio pooled over the job run's other attempts; failing that, its
  training time to its end over the steps it reached (an upper bound: it includes the tail after the
  last step).
- lost steps per cause: per non-completed attempt, last step reached - last step kept; the cause is
  the attempt's outcome (preempted, crashed, lost, cancelled, provision_failed).
- lost GPU-seconds: lost steps x the attempt's seconds per step x GPUs per worker. The job spec is not
  stored in SQL (only its hash), so GPUs per worker is 1 unless the caller knows the spec (a
  `distributed` spec: nproc_per_node x nnodes); the report says which.
- recovery time of an attempt: from the end of the previous attempt that had a worker (the failure
  seen) to this attempt's first step after resuming: the trainer's `started` record, sent after the
  restore and just before the first step (`extra.started_training_at`); without one, to the attempt's
  start, and the report says so. A provision failure has no recovery of its own: it lengthens the next.
- checkpoint overhead: only `checkpoint.every: auto` attempts store what a checkpoint costs
  (`extra.checkpoint_interval`: cost C per checkpoint, one every T seconds of training); their
  training time x C / (T + C) estimates it. Other attempts' save times are not in SQL.
- cost: the attempts' `extra.cost` (usd, on_demand_usd), where a provider priced them (EC2 does; the
  local simulator does not), plus their warm standbys' `extra.warm.usd` (tasks/control/warm.py): a
  standby is a second worker. Its seconds are reported apart (`warm_standby_s`, `warm_usd`).

A figure that cannot be computed from the rows is None, and `unavailable` says why; a figure computed
with an assumption or from part of the attempts has a line in `notes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from spotrun.tasks.decisions.attempts import AttemptRecord, Outcome
from spotrun.tasks.decisions.lost_steps import lost_steps, trained_at, walk

RUNNING = "running"  # tasks.history.JobStatus.RUNNING (not imported: no SQLAlchemy here)


@dataclass(frozen=True)
class RunInfo:
    """What the report needs of the job run beyond its attempts."""

    job: str
    job_run_id: str
    status: str  # a tasks.history.JobStatus value
    ended_at: float | None  # epoch seconds; None while it runs (or when its controller died)
    gpus_per_worker: int | None = None  # None: the spec is unknown (not stored in SQL), 1 assumed


@dataclass(frozen=True)
class AttemptFigures:
    attempt: int
    outcome: str
    start_step: int  # the step it resumed from (0: scratch)
    last_step: int
    kept_step: int  # its last step that counts
    lost_steps: int
    s_per_step: float | None
    s_per_step_from: str  # "attempt", "job run" (pooled), "attempt end" (upper bound) or "" (none)
    effective_s: float | None  # its share of ETT
    lost_gpu_s: float | None
    recovery_s: float | None  # None for the first attempt and for provision failures
    recovery_to: str  # "first step", "attempt start" or ""
    checkpoint_overhead_s: float | None


@dataclass(frozen=True)
class CauseLoss:
    cause: str  # an Outcome value
    attempts: int
    lost_steps: int
    lost_gpu_s: float | None


@dataclass(frozen=True)
class GoodputReport:
    job: str
    job_run_id: str
    status: str
    started_at: float | None  # the first attempt's start
    ended_at: float | None  # where wall time ends
    wall_end: str  # "job end", "now", "last attempt end" or "" (no attempts)
    wall_s: float
    effective_s: float | None
    goodput: float | None
    final_step: int
    total_steps: int | None
    lost_steps: int
    lost_gpu_s: float | None
    gpus_per_worker: int
    lost_by_cause: list[CauseLoss]
    recoveries: int
    recovery_s: float | None  # summed over recoveries
    recovery_max_s: float | None
    checkpoint_overhead_s: float | None
    cost_usd: float | None
    on_demand_usd: float | None
    saved: float | None  # 1 - cost / on-demand cost
    attempts: list[AttemptFigures]
    unavailable: dict[str, str] = field(default_factory=dict)  # figure -> why it is None
    # the job's deadline (epoch seconds, from the attempts' market decisions) and what was left of it at
    # the wall time's end: negative when late; None without a deadline
    deadline_at: float | None = None
    deadline_margin_s: float | None = None
    notes: list[str] = field(default_factory=list)  # assumptions and partial coverage
    warm_standby_s: float = 0.0  # seconds standby workers waited (tasks/control/warm.py)
    warm_usd: float | None = None  # what they cost, where priced (in cost_usd too)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def compute(attempts: Sequence[AttemptRecord], run: RunInfo, now: float) -> GoodputReport:
    """The report of one job run from its attempts (any order) and the time it is computed at."""
    rows = sorted(attempts, key=lambda r: r.attempt)
    unavailable: dict[str, str] = {}
    notes: list[str] = []
    gpus = run.gpus_per_worker or 1
    if run.gpus_per_worker is None:
        notes.append("GPUs per worker: 1 assumed: the job spec is not stored in SQL (only its hash)")

    starts, kept = walk(rows)
    pooled = _pooled_s_per_step(rows, starts)
    figures: list[AttemptFigures] = []
    prev_end: float | None = None  # the end of the previous attempt that had a worker
    for r, start, keep in zip(rows, starts, kept, strict=True):
        sps, sps_from = _s_per_step(r, start, pooled)
        lost = lost_steps(r.last_step, keep)
        effective = _effective_s(r, start, keep, sps)
        lost_gpu = 0.0 if lost == 0 else (lost * sps * gpus if sps is not None else None)
        recovery, to = None, ""
        if r.outcome is not Outcome.PROVISION_FAILED:
            if prev_end is not None:
                trained = trained_at(r)
                recovery = max(0.0, (trained if trained is not None else r.started_at) - prev_end)
                to = "first step" if trained is not None else "attempt start"
            prev_end = r.ended_at
        figures.append(
            AttemptFigures(
                attempt=r.attempt,
                outcome=r.outcome.value,
                start_step=start,
                last_step=r.last_step,
                kept_step=keep,
                lost_steps=lost,
                s_per_step=sps,
                s_per_step_from=sps_from,
                effective_s=effective,
                lost_gpu_s=lost_gpu,
                recovery_s=recovery,
                recovery_to=to,
                checkpoint_overhead_s=_checkpoint_overhead_s(r),
            )
        )

    started_at, ended_at, wall_end = _wall(rows, run, now)
    wall_s = max(0.0, ended_at - started_at) if started_at is not None and ended_at is not None else 0.0
    if run.status == RUNNING and rows:
        notes.append("job run still running: an attempt in flight is not in SQL until it ends")

    effective_s: float | None = sum(f.effective_s or 0.0 for f in figures)
    no_timing = [f.attempt for f in figures if f.effective_s is None]
    if not rows:
        effective_s = None
        unavailable["effective_s"] = "no attempt of this job run is recorded yet"
    elif no_timing:
        notes.append(f"ETT leaves out attempt(s) {_ids(no_timing)}: no step timing stored for them")
    for f in figures:
        if f.s_per_step_from == "job run":
            notes.append(
                f"attempt {f.attempt}: seconds per step pooled over the job run (no durable progress)"
            )
        elif f.s_per_step_from == "attempt end":
            notes.append(f"attempt {f.attempt}: seconds per step measured to its end (an upper bound)")
    goodput = effective_s / wall_s if effective_s is not None and wall_s > 0 else None
    if goodput is None:
        unavailable["goodput"] = unavailable.get("effective_s", "wall time is zero")

    lost_gpu_s = _sum_or_none([f.lost_gpu_s for f in figures])
    if lost_gpu_s is None:
        unavailable["lost_gpu_s"] = "an attempt with lost steps has no step timing stored"

    recs = [f for f in figures if f.recovery_s is not None]
    recovery_s = sum(f.recovery_s or 0.0 for f in recs) if recs else None
    recovery_max_s = max(f.recovery_s or 0.0 for f in recs) if recs else None
    to_start = [f.attempt for f in recs if f.recovery_to == "attempt start"]
    if to_start:
        notes.append(
            f"recovery of attempt(s) {_ids(to_start)} measured to the attempt's start"
            " (no `started` record; marked *)"
        )

    overhead_s = _checkpoint_total(figures, unavailable, notes)
    cost_usd, on_demand_usd = _cost(rows, unavailable, notes)
    standby_s, warm_usd = _warm(rows)
    if cost_usd is not None and warm_usd is not None:
        cost_usd += warm_usd
    saved = 1 - cost_usd / on_demand_usd if cost_usd is not None and on_demand_usd else None
    total_steps = next(
        (int(t) for r in reversed(rows) if (t := r.extra.get("total_steps")) is not None), None
    )
    dated = [r.extra["deadline_at"] for r in rows if isinstance(r.extra.get("deadline_at"), int | float)]
    deadline = float(dated[-1]) if dated else None
    return GoodputReport(
        job=run.job,
        job_run_id=run.job_run_id,
        status=run.status,
        started_at=started_at,
        ended_at=ended_at,
        wall_end=wall_end,
        wall_s=wall_s,
        effective_s=effective_s,
        goodput=goodput,
        final_step=max((r.last_step for r in rows), default=0),
        total_steps=total_steps,
        lost_steps=sum(f.lost_steps for f in figures),
        lost_gpu_s=lost_gpu_s,
        gpus_per_worker=gpus,
        lost_by_cause=_by_cause(figures),
        recoveries=len(recs),
        recovery_s=recovery_s,
        recovery_max_s=recovery_max_s,
        checkpoint_overhead_s=overhead_s,
        cost_usd=cost_usd,
        on_demand_usd=on_demand_usd,
        saved=saved,
        attempts=figures,
        unavailable=unavailable,
        notes=notes,
        deadline_at=deadline,
        deadline_margin_s=deadline - ended_at if deadline is not None and ended_at is not None else None,
        warm_standby_s=standby_s,
        warm_usd=warm_usd,
    )


# -- steps --------------------------------------------------------------------------------------


def _own_s_per_step(r: AttemptRecord, start: int) -> float | None:
    durable = r.last_durable_step
    if durable is None or durable <= start or r.productive_s <= 0:
        return None
    return r.productive_s / (durable - start)


def _pooled_s_per_step(rows: list[AttemptRecord], starts: list[int]) -> float | None:
    timed = [
        (r.productive_s, (r.last_durable_step or 0) - s)
        for r, s in zip(rows, starts, strict=True)
        if _own_s_per_step(r, s) is not None
    ]
    return sum(t for t, _ in timed) / sum(n for _, n in timed) if timed else None


def _s_per_step(r: AttemptRecord, start: int, pooled: float | None) -> tuple[float | None, str]:
    own = _own_s_per_step(r, start)
    if own is not None:
        return own, "attempt"
    if r.last_step <= start:
        return None, ""  # no step trained: nothing to time
    if pooled is not None:
        return pooled, "job run"
    trained = trained_at(r)
    if trained is not None and r.ended_at > trained:
        return (r.ended_at - trained) / (r.last_step - start), "attempt end"
    return None, ""


def _effective_s(r: AttemptRecord, start: int, keep: int, sps: float | None) -> float | None:
    if keep <= start:
        return 0.0
    if keep == r.last_durable_step and _own_s_per_step(r, start) is not None:
        return r.productive_s  # exactly the stored figure, without a round trip through a ratio
    return (keep - start) * sps if sps is not None else None


def _by_cause(figures: list[AttemptFigures]) -> list[CauseLoss]:
    causes = sorted({f.outcome for f in figures if f.outcome != Outcome.COMPLETED.value})
    out = []
    for cause in causes:
        of = [f for f in figures if f.outcome == cause]
        out.append(
            CauseLoss(cause, len(of), sum(f.lost_steps for f in of), _sum_or_none([f.lost_gpu_s for f in of]))
        )
    return out


# -- time ---------------------------------------------------------------------------------------


def _wall(rows: list[AttemptRecord], run: RunInfo, now: float) -> tuple[float | None, float | None, str]:
    if not rows:
        return None, None, ""
    first, last = min(r.started_at for r in rows), max(r.ended_at for r in rows)
    if run.ended_at is not None:
        end, why = run.ended_at, "job end"
    elif run.status == RUNNING:
        end, why = now, "now"
    else:
        end, why = last, "last attempt end"
    return first, max(end, last), why


def _checkpoint_overhead_s(r: AttemptRecord) -> float | None:
    iv, trained = r.extra.get("checkpoint_interval"), trained_at(r)
    if not isinstance(iv, dict) or trained is None:
        return None
    every, cost = iv.get("seconds"), iv.get("cost_s")
    if not isinstance(every, int | float) or not isinstance(cost, int | float) or every + cost <= 0:
        return None
    return max(0.0, r.ended_at - trained) * cost / (every + cost)


def _checkpoint_total(
    figures: list[AttemptFigures], unavailable: dict[str, str], notes: list[str]
) -> float | None:
    trained = [f for f in figures if f.outcome != Outcome.PROVISION_FAILED.value]
    known = [f for f in trained if f.checkpoint_overhead_s is not None]
    if not known:
        unavailable["checkpoint_overhead_s"] = (
            "checkpoint save times are not stored in SQL; only `checkpoint.every: auto` attempts record"
            " the cost per checkpoint (extra.checkpoint_interval)"
        )
        return None
    notes.append("checkpoint overhead estimated from the `every: auto` choice: training time x C / (T + C)")
    missing = [f.attempt for f in trained if f.checkpoint_overhead_s is None]
    if missing:
        notes.append(
            f"checkpoint overhead leaves out attempt(s) {_ids(missing)}: no cost per checkpoint stored"
        )
    return sum(f.checkpoint_overhead_s or 0.0 for f in known)


# -- cost ---------------------------------------------------------------------------------------


def _cost(
    rows: list[AttemptRecord], unavailable: dict[str, str], notes: list[str]
) -> tuple[float | None, float | None]:
    priced = [(r.attempt, r.extra["cost"]) for r in rows if isinstance(r.extra.get("cost"), dict)]
    if not priced:
        why = "no attempt row carries a price (extra.cost): the local simulator prices only a trace replay"
        unavailable["cost_usd"] = unavailable["on_demand_usd"] = why
        return None, None
    unpriced = [
        r.attempt for r in rows if r.outcome is not Outcome.PROVISION_FAILED and "cost" not in r.extra
    ]
    if unpriced:
        notes.append(f"cost leaves out attempt(s) {_ids(unpriced)}: no price stored for them")

    def total(key: str, figure: str, why: str) -> float | None:
        values = [(n, c.get(key)) for n, c in priced]
        unknown = [n for n, v in values if not isinstance(v, int | float)]
        if unknown:
            unavailable[figure] = f"{why} for attempt(s) {_ids(unknown)}"
            return None
        return float(sum(v for _, v in values if isinstance(v, int | float)))

    spot = total("usd", "cost_usd", "the spot price was unknown")
    return spot, total("on_demand_usd", "on_demand_usd", "no on-demand price configured")


def _warm(rows: list[AttemptRecord]) -> tuple[float, float | None]:
    """Seconds the attempts' standbys waited, and their USD where every one was priced."""
    kept = [w for r in rows if isinstance(w := r.extra.get("warm"), dict)]
    usd = [float(u) for w in kept if isinstance(u := w.get("usd"), int | float)]
    stood = float(sum(w.get("standby_s", 0.0) for w in kept))
    return stood, (sum(usd) if kept and len(usd) == len(kept) else None)


# -- helpers ------------------------------------------------------------------------------------


def _sum_or_none(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else sum(v or 0.0 for v in values)


def _ids(numbers: list[int]) -> str:
    return ", ".join(str(n) for n in numbers)


# -- views: the lines the CLI table and a Markdown summary share, the plot's progress lines ---------


def summary_rows(rep: GoodputReport) -> list[tuple[str, str]]:
    """(figure, value) pairs, in the order a reader wants them; "unavailable" where a figure is None."""

    def secs(x: float | None, key: str) -> str:
        return f"{x:.1f} s" if x is not None else _na(rep, key)

    progress = f"{rep.final_step}" + (f" / {rep.total_steps}" if rep.total_steps is not None else "")
    causes = ", ".join(f"{c.cause} {c.lost_steps}" for c in rep.lost_by_cause if c.lost_steps) or "none"
    gpu = f"{rep.lost_gpu_s:.1f}" if rep.lost_gpu_s is not None else _na(rep, "lost_gpu_s")
    recovery = "none"
    if rep.recoveries and rep.recovery_s is not None and rep.recovery_max_s is not None:
        mean = rep.recovery_s / rep.recoveries
        recovery = f"{rep.recoveries} x, mean {mean:.1f} s, max {rep.recovery_max_s:.1f} s"
    cost = f"{_usd(rep.cost_usd)} spot" if rep.cost_usd is not None else _na(rep, "cost_usd")
    if rep.on_demand_usd is not None:
        cost += f" vs {_usd(rep.on_demand_usd)} on demand"
        cost += f" ({rep.saved:.0%} saved)" if rep.saved is not None else ""
    overhead = secs(rep.checkpoint_overhead_s, "checkpoint_overhead_s")
    if rep.checkpoint_overhead_s is not None and rep.effective_s:
        overhead += f" ({rep.checkpoint_overhead_s / rep.effective_s:.1%} of ETT)"
    return [
        ("wall time", f"{rep.wall_s:.1f} s (first attempt start -> {rep.wall_end or 'n/a'})"),
        ("effective training time", secs(rep.effective_s, "effective_s")),
        ("goodput", f"{rep.goodput:.1%}" if rep.goodput is not None else _na(rep, "goodput")),
        ("steps", f"{progress} in {len(rep.attempts)} attempt(s)"),
        ("lost steps", f"{rep.lost_steps} ({causes})"),
        ("lost GPU-seconds", f"{gpu} ({rep.gpus_per_worker} GPU(s) per worker)"),
        ("recovery", recovery),
        ("checkpoint overhead", overhead),
        ("cost", cost),
        *([("deadline", _deadline(rep))] if rep.deadline_margin_s is not None else []),
        *([("warm standby", _standby(rep))] if rep.warm_standby_s else []),
    ]


def _standby(rep: GoodputReport) -> str:
    usd = f", {_usd(rep.warm_usd)} (in the cost)" if rep.warm_usd is not None else ""
    return f"{rep.warm_standby_s:.1f} s{usd}"


def _deadline(rep: GoodputReport) -> str:
    """`met with 1.20 h to spare`, `missed by 0.30 h`, or, while the job runs, what is left."""
    margin = rep.deadline_margin_s or 0.0
    hours = f"{abs(margin) / 3600:.2f} h"
    if rep.status == RUNNING:
        return f"{hours} left" if margin >= 0 else f"passed {hours} ago"
    return f"met with {hours} to spare" if margin >= 0 else f"missed by {hours}"


def _usd(x: float) -> str:
    return f"${x:.2f}" if x >= 0.01 or x == 0 else f"${x:.2g}"  # cents, or what a short test run cost


def _na(rep: GoodputReport, key: str) -> str:
    return "unavailable" if key in rep.unavailable else "n/a"


def markdown(rep: GoodputReport) -> str:
    """The report as Markdown (a summary artifact): the figures, the losses per cause, what is missing."""
    lines = [
        f"# {rep.job}: goodput report (job run {rep.job_run_id}, {rep.status})",
        "",
        "| figure | value |",
    ]
    lines += ["|---|---|", *(f"| {k} | {v} |" for k, v in summary_rows(rep)), ""]
    if rep.lost_by_cause:
        lines += ["| cause | attempts | lost steps | lost GPU-s |", "|---|---|---|---|"]
        for c in rep.lost_by_cause:
            gpu = f"{c.lost_gpu_s:.1f}" if c.lost_gpu_s is not None else "unavailable"
            lines.append(f"| {c.cause} | {c.attempts} | {c.lost_steps} | {gpu} |")
        lines.append("")
    lines += [f"- unavailable: {k}: {v}" for k, v in rep.unavailable.items()]
    lines += [f"- note: {n}" for n in rep.notes]
    return "\n".join(lines)


@dataclass(frozen=True)
class Progress:
    """One attempt's step against wall time, drawn from its rows: training start, the step kept, its last
    step (interpolated at its seconds per step; SQL stores no step samples)."""

    attempt: int
    outcome: str
    started_at: float
    ended_at: float
    points: list[tuple[float, int]]
    kept_step: int
    start_step: int


def progress(attempts: Sequence[AttemptRecord], rep: GoodputReport) -> list[Progress]:
    by_n = {r.attempt: r for r in attempts}
    out = []
    for f in rep.attempts:
        r = by_n[f.attempt]
        t0 = trained_at(r)
        points: list[tuple[float, int]] = []
        if t0 is not None or r.last_step > f.start_step:
            t0 = t0 if t0 is not None else r.started_at
            sps = f.s_per_step
            points.append((t0, f.start_step))
            if sps is not None and f.start_step < f.kept_step < f.last_step:
                points.append((t0 + (f.kept_step - f.start_step) * sps, f.kept_step))
            last_t = r.ended_at if sps is None else min(r.ended_at, t0 + (f.last_step - f.start_step) * sps)
            points.append((max(t0, last_t), f.last_step))
        out.append(
            Progress(
                f.attempt,
                f.outcome,
                r.started_at,
                ended_at=r.ended_at,
                points=points,
                kept_step=f.kept_step,
                start_step=f.start_step,
            )
        )
    return out
