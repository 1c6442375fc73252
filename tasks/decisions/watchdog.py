"""How long a start-up, a step and a save may take: the watchdog's timeouts, as pure functions.

One rule per section (start-up, step, save), applied in this order:
  1. the job file fixes it (`watchdog.step_s`)                                source "job file"
  2. the attempt has measured `min_samples` of its own: max(floor, k x p99)   source "attempt"
  3. the job's history in SQL measured it: max(floor, k x the largest p99     source "history"
     of its recent attempts)
  4. nothing measured yet: the provider's heartbeat timeout                   source "heartbeat"
so a job is never held to a tighter limit than today's heartbeat before its own times say so. A
"heartbeat" limit is recorded but not enforced by the watchdog: the provider's own silence check
already is that limit (the attempt ends `lost`, as before), and two clocks racing for one kill would
make the outcome a coin toss.

What is measured, all from the trainer's status records (their `t`, the trainer's clock), so the same on
every provider: a step is the gap between two progress records (one per step for steps over 0.25 s,
else about every 0.25 s: the status reporter's rate limit), which is what silence is compared with;
a save is `saving` to its `durable`; a start-up is `started` to the first progress record. Each
attempt's figures go into its row (`extra.watchdog.measured`) and become the next attempts' history.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from spotrun.trainer.spec.watchdog import SECTIONS, WatchdogOptions

HISTORY_ATTEMPTS = 10  # the newest attempts whose figures calibrate the next one


@dataclass(frozen=True)
class Limit:
    """One section's timeout and where it came from."""

    seconds: float
    source: str  # "job file" | "attempt" | "history" | "heartbeat"
    p99_s: float | None = None  # the measured p99 it was calibrated from
    samples: int = 0  # how many times that p99 was taken over

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Measured:
    """One attempt's own figures, as its row stores them (`extra.watchdog.measured`)."""

    step_p99_s: float | None = None
    steps: int = 0
    save_p99_s: float | None = None
    saves: int = 0
    startup_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def p99(samples: Sequence[float]) -> float:
    """The 99th percentile (nearest rank): with under 100 samples, the largest."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def limit(
    own: Sequence[float],
    history: Sequence[float],
    *,
    fixed_s: float | None,
    floor_s: float,
    multiplier: float,
    min_samples: int,
    fallback_s: float,
) -> Limit:
    """One section's timeout by the module's rule: `own` are this attempt's samples, `history` the p99
    figures of earlier attempts (newest first), `fallback_s` the provider's heartbeat timeout."""
    if fixed_s is not None:
        return Limit(fixed_s, "job file")
    if len(own) >= min_samples:
        q = p99(own)
        return Limit(max(floor_s, multiplier * q), "attempt", q, len(own))
    if history:
        q = max(history)
        return Limit(max(floor_s, multiplier * q), "history", q, len(history))
    return Limit(fallback_s, "heartbeat")


def limits(
    opts: WatchdogOptions,
    own: Mapping[str, Sequence[float]],
    history: Mapping[str, Sequence[float]],
    fallback_s: float,
) -> dict[str, Limit]:
    """Every section's timeout (keys: SECTIONS). An attempt starts once: its start-up limit comes from
    the history (or the fallback), never from `own`."""
    return {
        s: limit(
            own.get(s, ()),
            history.get(s, ()),
            fixed_s=opts.fixed(s),
            floor_s=opts.floor(s),
            multiplier=opts.multiplier,
            min_samples=opts.min_samples,
            fallback_s=fallback_s,
        )
        for s in SECTIONS
    }


def history_figures(extras: Iterable[dict[str, Any]]) -> dict[str, list[float]]:
    """Per section, the figures earlier attempts measured (rows' `extra`, newest first: their step and
    save p99 and their start-up), from the newest HISTORY_ATTEMPTS that measured any."""
    out: dict[str, list[float]] = {s: [] for s in SECTIONS}
    used = 0
    for extra in extras:
        m = (extra.get("watchdog") or {}).get("measured")
        if not isinstance(m, dict) or used >= HISTORY_ATTEMPTS:
            continue
        used += 1
        for section, key in (("startup", "startup_s"), ("step", "step_p99_s"), ("save", "save_p99_s")):
            value = m.get(key)
            if isinstance(value, int | float) and value > 0:
                out[section].append(float(value))
    return out


def measured(starts: Sequence[float], steps: Sequence[float], saves: Sequence[float]) -> Measured:
    """An attempt's figures from its samples."""
    return Measured(
        step_p99_s=round(p99(steps), 6) if steps else None,
        steps=len(steps),
        save_p99_s=round(p99(saves), 6) if saves else None,
        saves=len(saves),
        startup_s=round(starts[0], 6) if starts else None,
    )


def describe(fired: dict[str, Any]) -> str:
    """One line for a firing: what hung, for how long, against which limit (or which rule fired)."""
    if fired.get("detail"):  # a rule (loss spike, throughput collapse) says its own line
        return str(fired["detail"])
    section = fired.get("section", "")
    what = {
        "startup": "no first step after start",
        "step": f"no step after step {fired.get('step')}",
        "save": f"checkpoint of step {fired.get('saving_step')} not durable",
        "section": f"{fired.get('name') or 'section'} after step {fired.get('step')} not over",
    }.get(section, "no progress")
    silent, timeout = fired.get("silent_s", 0.0), fired.get("timeout_s", 0.0)
    return (
        f"hung: {what} for {silent:.1f} s ({section} timeout {timeout:g} s, from the {fired.get('source')})"
    )
