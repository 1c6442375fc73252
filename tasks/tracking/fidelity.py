"""Resume fidelity: did the resumed attempt continue the training the lost one was doing?

After a reclaim without notice the steps between the last durable checkpoint and the reclaim are
computed twice: by the attempt that was lost and by the one that resumed. Their losses are compared:

    exact     every compared step bitwise equal (losses, and learning rates where both are known)
    close     all within the relative tolerance `tracking.resume_rtol` (default 1e-3), not all bitwise
    mismatch  some step beyond it: the resume did not restore what the run depends on

With a notice nothing is computed twice (the emergency checkpoint is the last step), so the resumed
attempt's first step is checked against what the lost one left: its learning rate against the rate the
scheduler had set for that step (`lr_next` in the metrics object), bitwise; its loss against the lost
attempt's recent trend (within TREND_SIGMAS standard deviations of the last TREND_WINDOW losses, plus
TREND_SLACK of their mean). `exact` there means the rate matched bit for bit and the loss lies in the
trend; `close`: the rate within the tolerance; `mismatch`: either is off. A trend can only refute: with
no rate to compare (the attempt ended before its first durable checkpoint), a loss in the trend gives
no verdict, one off it `mismatch`.

Where the values come from: the local provider's trainers append every step's loss to one metrics file
per job (`--metrics`), so a lost attempt's steps are all there. Other providers (EC2) keep no file the
controller can read after the instance is gone: the lost attempt's `step` status records (at most 4 a
second) are the samples compared, every one the controller saw and every one the trainer's last
heartbeat carried (those after its newest durable checkpoint: trainer/telemetry/heartbeat.py), each against
the resumed attempt's value for that step from storage. Steps after the last heartbeat write (at most 5 s
of training) are not compared.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from spotrun.tasks.decisions.attempts import AttemptRecord, Outcome
from spotrun.tasks.providers.base import WatchResult, Worker
from spotrun.tasks.tracking.steps import StepMetrics, read_steps
from spotrun.trainer.storage import Storage

EXACT, CLOSE, MISMATCH = "exact", "close", "mismatch"
VERDICTS = (EXACT, CLOSE, MISMATCH)  # best first
# A command's resume with no value computed twice (its script reports no loss, or none over the same
# steps): nothing says it was exact. A run with one is no better than `unchecked`, and no worse than
# `close` (which found a difference).
UNCHECKED = "unchecked"
RUN_ORDER = (EXACT, UNCHECKED, CLOSE, MISMATCH)
REPLAY, CONTINUITY = "replay", "continuity"
TREND_WINDOW, TREND_SIGMAS, TREND_SLACK = 50, 4.0, 0.25
MIN_TREND = 5  # fewer recent losses than this: the loss is not judged, only the rate


@dataclass(frozen=True)
class Value:
    """What one step gave: its loss, and its learning rate when known."""

    loss: float
    lr: float | None = None


@dataclass(frozen=True)
class Verdict:
    verdict: str  # exact | close | mismatch
    steps: int  # steps compared
    first_diff: int | None  # the first step not bitwise equal
    max_rel: float  # the largest relative difference seen
    detail: str  # one line for people
    span: str = ""  # the steps compared: "steps 51-60", "step 11"
    diff: str = ""  # the first step not bitwise equal and its values before and after the resume

    def worse(self, other: Verdict) -> Verdict:
        return self if VERDICTS.index(self.verdict) >= VERDICTS.index(other.verdict) else other


@dataclass(frozen=True)
class ResumeCheck:
    """The verdict on one resumed attempt, as the attempt's SQL row, event and MLflow tag carry it."""

    attempt: int
    method: str  # replay | continuity
    resumed_from: int
    verdict: str
    steps: int
    first_diff: int | None
    max_rel: float
    detail: str
    span: str = ""  # see Verdict (rows written before it was added have "")
    diff: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        return f"attempt {self.attempt}: {self.verdict} ({self.detail})"


def rel_diff(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def replay_verdict(lost: Mapping[int, Value], resumed: Mapping[int, Value], rtol: float) -> Verdict | None:
    """Compare the steps both computed; None when they share none."""
    common = sorted(set(lost) & set(resumed))
    if not common:
        return None
    first_diff, worst = None, 0.0
    for s in common:
        a, b = lost[s], resumed[s]
        pairs = [(a.loss, b.loss)] + ([(a.lr, b.lr)] if a.lr is not None and b.lr is not None else [])
        rel = max(rel_diff(x, y) for x, y in pairs)
        if first_diff is None and any(x.hex() != y.hex() for x, y in pairs):
            first_diff = s
        worst = max(worst, rel)
    span = f"step {common[0]}" if len(common) == 1 else f"steps {common[0]}-{common[-1]}"
    n = f"{len(common)} step(s) computed twice ({span})"
    if first_diff is None:
        return Verdict(EXACT, len(common), None, max_rel=0.0, detail=f"{n}: bitwise equal", span=span)
    a, b = lost[first_diff], resumed[first_diff]
    diff = f"step {first_diff}: loss {a.loss!r} before the reclaim, {b.loss!r} after"
    if a.lr is not None and b.lr is not None and a.lr != b.lr:
        diff += f"; lr {a.lr!r} before, {b.lr!r} after"
    if worst <= rtol:
        return Verdict(
            CLOSE,
            len(common),
            first_diff,
            max_rel=worst,
            detail=f"{n}: within {rtol:g} "
            f"(largest relative difference {worst:.2g}, first at step {first_diff})",
            span=span,
            diff=diff,
        )
    return Verdict(
        MISMATCH,
        len(common),
        first_diff,
        max_rel=worst,
        detail=f"{n}: step {first_diff} differs, largest relative difference {worst:.2g} > {rtol:g}",
        span=span,
        diff=diff,
    )


def continuity_verdict(
    step: int,
    expected_lr: float | None,
    first: Value | None,
    *,
    recent: Sequence[float],
    rtol: float,
) -> Verdict | None:
    """The resumed attempt's first step (`step`) against the schedule and the recent trend; None when
    there is nothing to compare."""
    if first is None:
        return None
    parts: list[Verdict] = []
    if expected_lr is not None and first.lr is not None:
        rel = rel_diff(expected_lr, first.lr)
        if expected_lr.hex() == first.lr.hex():
            parts.append(
                Verdict(EXACT, 1, None, max_rel=0.0, detail=f"learning rate at step {step} as scheduled")
            )
        else:
            kind = CLOSE if rel <= rtol else MISMATCH
            parts.append(
                Verdict(
                    kind,
                    1,
                    step,
                    max_rel=rel,
                    detail=f"learning rate at step {step} {first.lr:.6g}, scheduled {expected_lr:.6g}",
                )
            )
    if len(recent) >= MIN_TREND:
        mean = sum(recent) / len(recent)
        sd = math.sqrt(sum((x - mean) ** 2 for x in recent) / len(recent))
        band = TREND_SIGMAS * sd + TREND_SLACK * abs(mean)
        off = abs(first.loss - mean)
        if off <= band and parts:  # the trend can only refute: alone it proves no bits, so no verdict
            trend = f"loss {first.loss:.4g} in the trend ({mean:.4g} ± {band:.2g})"
            parts[0] = replace(parts[0], detail=f"{parts[0].detail}; {trend}")
        elif off > band:
            parts.append(
                Verdict(
                    MISMATCH,
                    1,
                    step,
                    max_rel=off / max(abs(mean), 1e-30),
                    detail=f"loss {first.loss:.4g} off the trend ({mean:.4g} ± {band:.2g})",
                )
            )
    if not parts:
        return None
    worst = parts[0]
    for p in parts[1:]:
        worst = worst.worse(p)
    detail = "; ".join(p.detail for p in parts)
    diff = f"step {step}: {detail}" if worst.verdict != EXACT else ""
    return Verdict(
        worst.verdict,
        1,
        worst.first_diff,
        max_rel=max(p.max_rel for p in parts),
        detail=detail,
        span=f"step {step}",
        diff=diff,
    )


def worst_verdict(verdicts: Sequence[str]) -> str | None:
    """The run's verdict from its resumes': the worst (mismatch > close > unchecked > exact); None for
    none."""
    known = [v for v in verdicts if v in RUN_ORDER]
    return max(known, key=RUN_ORDER.index) if known else None


# -- where the values come from ---------------------------------------------------------------------


def local_metrics_file(worker: Worker) -> Path | None:
    """The `--metrics` file a local worker's trainer appends to (one per job and storage; every attempt
    of the job writes it); None for other providers."""
    proc = getattr(worker.handle, "proc", None)
    args = getattr(proc, "args", None)
    if not isinstance(args, list) or "--metrics" not in args:
        return None
    i = args.index("--metrics")
    return Path(args[i + 1]) if i + 1 < len(args) else None


def read_losses(path: Path) -> list[tuple[int, float]]:
    """(step, loss) per line of a trainer's metrics file, in file order; torn lines skipped."""
    out = []
    try:
        text = path.read_text()
    except OSError:
        return []
    for line in text.splitlines():
        try:
            d = json.loads(line)
            out.append((int(d["step"]), float.fromhex(d["loss"])))
        except (ValueError, KeyError, TypeError):
            continue
    return out


def replayed(
    lines: Sequence[tuple[int, float]], resumed_from: int
) -> tuple[dict[int, float], dict[int, float]]:
    """From a metrics file (attempts appended one after another), the lost attempt's and the resumed
    attempt's losses for the steps after `resumed_from`. The resumed attempt's lines start at the last
    line past `resumed_from` that goes back (its step is not after the line before: a restart that
    computes steps again), or that is step resumed_from + 1 without continuing the line before; the lost
    attempt's are the rising run just before that. Steps may be sparse (a Transformers script logs every
    `logging_steps`): only steps both attempts logged are compared later. ({}, {}) when no attempt
    restarted there."""
    start = next(
        (
            i
            for i in range(len(lines) - 1, 0, -1)
            if lines[i][0] > resumed_from
            and (
                lines[i][0] <= lines[i - 1][0]
                or (lines[i][0] == resumed_from + 1 and lines[i - 1][0] != resumed_from)
            )
        ),
        None,
    )
    if start is None:
        return {}, {}
    lost: dict[int, float] = {}
    i = start - 1
    while i >= 0 and lines[i][0] > resumed_from and (i == start - 1 or lines[i][0] < lines[i + 1][0]):
        lost[lines[i][0]] = lines[i][1]
        i -= 1
    mine: dict[int, float] = {}
    for j in range(start, len(lines)):
        if j > start and lines[j][0] <= lines[j - 1][0]:
            break
        mine[lines[j][0]] = lines[j][1]
    return lost, mine


class ResumeChecker:
    """Checks each attempt that resumed after another, from what the run log sees of both."""

    def __init__(self, storage: Storage, rtol: float, *, command: bool = False) -> None:
        """`command`: the job is a `command:` (its script's losses are sparse or absent): a resume with
        nothing to compare is recorded as `unchecked` rather than not at all."""
        self.storage, self.rtol, self.command = storage, rtol, command
        self._last_losses: dict[int, float] = {}  # the previous attempt's step records' losses

    def check(
        self, worker: Worker, result: WatchResult, previous: AttemptRecord | None, attempt: int
    ) -> ResumeCheck | None:
        """The verdict on `attempt` (which `result` describes), given the attempt before it; None when
        there is nothing to check (the first attempt, one that never started, or no values: for a
        command, `unchecked`)."""
        samples, self._last_losses = self._last_losses, dict(result.losses)
        if previous is None or result.started is None:
            return None
        if previous.outcome in (Outcome.PROVISION_FAILED, Outcome.ROLLED_BACK):  # a spike's steps are
            return None  # thrown away on purpose, and the resumed attempt skips their data
        start = result.resumed_from or 0
        check = self._compare(worker, start, previous=previous, samples=samples, attempt=attempt)
        if check is None and self.command and (start > 0 or previous.last_step > 0):
            return ResumeCheck(
                attempt=attempt,
                method=REPLAY if previous.last_step > start else CONTINUITY,
                resumed_from=start,
                verdict=UNCHECKED,
                steps=0,
                first_diff=None,
                max_rel=0.0,
                detail="no loss the script reported was computed by both attempts over the same steps",
            )
        return check

    def _compare(
        self, worker: Worker, start: int, *, previous: AttemptRecord, samples: dict[int, float], attempt: int
    ) -> ResumeCheck | None:
        file = local_metrics_file(worker)
        lines = read_losses(file) if file is not None else []
        lost, mine = replayed(lines, start)
        prev_last = max([previous.last_step, *lost])
        if prev_last > start:
            return self._replay(attempt, start, lost, mine=mine, samples=samples)
        if start > 0:  # the file continues the line before: this attempt's first step is its last S+1
            first = [loss for step, loss in lines if step == start + 1][-1:]
            return self._continuity(attempt, start, {start + 1: first[0]} if first else {})
        return None

    def _replay(
        self,
        attempt: int,
        start: int,
        lost: dict[int, float],
        *,
        mine: dict[int, float],
        samples: dict[int, float],
    ) -> ResumeCheck | None:
        if not lost:  # no file: the lost attempt's step records past the resume point
            lost = {s: v for s, v in samples.items() if s > start}
        if not lost:
            return None
        durable = read_steps(self.storage, start, max(lost))
        resumed = {s: Value(m.loss, m.lr) for s, m in durable.items()}
        resumed |= {s: Value(v, resumed[s].lr if s in resumed else None) for s, v in mine.items()}
        v = replay_verdict({s: Value(x) for s, x in lost.items()}, resumed, self.rtol)
        return _check(attempt, REPLAY, start, v)

    def _continuity(self, attempt: int, start: int, mine: dict[int, float]) -> ResumeCheck | None:
        before = read_steps(self.storage, max(0, start - TREND_WINDOW), start + 1)
        after = before.get(start + 1)
        first = Value(after.loss, after.lr) if after is not None else None
        if start + 1 in mine:  # the file has every step; storage only the durable ones
            first = Value(mine[start + 1], first.lr if first is not None else None)
        last: StepMetrics | None = before.get(start)
        expected = last.lr_next if last is not None else None
        recent = [before[s].loss for s in sorted(before) if s <= start]
        v = continuity_verdict(start + 1, expected, first, recent=recent, rtol=self.rtol)
        return _check(attempt, CONTINUITY, start, v)


def _check(attempt: int, method: str, start: int, v: Verdict | None) -> ResumeCheck | None:
    if v is None:
        return None
    return ResumeCheck(
        attempt,
        method,
        start,
        verdict=v.verdict,
        steps=v.steps,
        first_diff=v.first_diff,
        max_rel=v.max_rel,
        detail=v.detail,
        span=v.span,
        diff=v.diff,
    )
