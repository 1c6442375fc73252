"""The trainer's status records, typed: what it reports to whoever supervises it (trainer/telemetry/status.py
writes them as `@spotrun {json}` lines, trainer/telemetry/heartbeat.py mirrors them into storage, the
providers in tasks/providers parse them back). One dataclass per kind, each with `t` (epoch seconds, the
trainer's clock):

  Started   resumed_from, checkpoint, rejected, step, total_steps    about to take the first step
            [, resharded_from, changes]                             (a resharded or changed resume)
            [, warm_start]                                          (a run started from another's)
  Step      step, loss, steps_per_s, durable_step[, standby_step]   progress, at most 4 a second
  Saving    step                                                    a checkpoint of `step` begun
  Durable   step                                                    a checkpoint verified in storage
  Notice    cloud, action, stop, deadline                           a cloud notice (rebalance: stop false)
  Stopping  reason, step [, save, save_reason, deadline]            a stop request reached the loop
  Interval  seconds, cost_s, mtbf_s, measured, reason               `every: auto` chose an interval
  Hook      event, command, code, timed_out, duration_s,           a hook of the job ran (trainer/hooks/),
            timeout_s, output, error                                before the exit record
  Exit      code, name, error, step, durable_step                   the attempt is over

The JSON form is `{"kind", "t", *fields in declaration order}`: `to_json` writes it, `parse_record`
reads it. Parsing is lenient where versions drift and strict where data is wrong: an unknown kind or
an unknown field is ignored (a newer trainer under an older controller), a missing optional field takes
its default (an older trainer), and a required field that is missing or a field of the wrong type makes
the record malformed (None, logged).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

log = logging.getLogger(__name__)

Check = Callable[[Any], Any]


class MalformedRecord(ValueError):
    """A record of a known kind whose fields do not hold what the kind promises."""


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise MalformedRecord(f"expected an integer, got {v!r}")
    return v


def _float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise MalformedRecord(f"expected a number, got {v!r}")
    return float(v)


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise MalformedRecord(f"expected a string, got {v!r}")
    return v


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise MalformedRecord(f"expected true or false, got {v!r}")
    return v


def _optional(check: Check) -> Check:
    return lambda v: None if v is None else check(v)


def _f(check: Check, default: Any = MISSING, omit_none: bool = False) -> Any:
    """A record field: `check` validates (and normalizes) its JSON value; `omit_none` leaves it out of the
    JSON when None (the stopping record's save fields exist only when the stop carried a deadline)."""
    return field(default=default, metadata={"check": check, "omit_none": omit_none})


@dataclass(frozen=True, slots=True)
class Rejected:
    """A checkpoint the trainer passed over when it chose where to resume, and why."""

    step: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Changed:
    """A training setting the resumed checkpoint was made with and this attempt changed (allowed by
    `resume.allow_changes`): values as JSON text. From here on the run is not bitwise equal to an
    uninterrupted one."""

    field: str  # "seed", "args.lr"
    old: str
    new: str


def _changes(v: Any) -> tuple[Changed, ...]:
    if not isinstance(v, list | tuple):
        raise MalformedRecord(f"expected a list of changes, got {v!r}")
    out = []
    for e in v:
        if isinstance(e, Changed):
            out.append(e)
        elif isinstance(e, Mapping) and "field" in e:
            out.append(Changed(_str(e["field"]), _str(e.get("old", "")), _str(e.get("new", ""))))
        else:
            raise MalformedRecord(f"expected {{field, old, new}}, got {e!r}")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class WarmStarted:
    """Where a run with `init_from` took its first weights from (trainer/session/warm_start.py): the source
    run the controller picked (`step` None: there was none), the parts asked for, and whether they were
    loaded (`reason`: why not). Every attempt of the run reports it: a resumed one from its checkpoint."""

    job: str
    run_key: str | None
    step: int | None
    parts: tuple[str, ...]
    loaded: bool
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        """The record's JSON form (also what trainer.pt keeps)."""
        return {
            "job": self.job,
            "run_key": self.run_key,
            "step": self.step,
            "parts": list(self.parts),
            "loaded": self.loaded,
            "reason": self.reason,
        }


def _warm_start(v: Any) -> WarmStarted:
    if isinstance(v, WarmStarted):
        return v
    if not isinstance(v, Mapping) or "job" not in v:
        raise MalformedRecord(f"expected {{job, run_key, step, parts, loaded, reason}}, got {v!r}")
    parts = v.get("parts", ())
    if not isinstance(parts, list | tuple):
        raise MalformedRecord(f"expected a list of parts, got {parts!r}")
    return WarmStarted(
        job=_str(v["job"]),
        run_key=_optional(_str)(v.get("run_key")),
        step=_optional(_int)(v.get("step")),
        parts=tuple(_str(p) for p in parts),
        loaded=_bool(v.get("loaded", False)),
        reason=_str(v.get("reason", "")),
    )


def _rejected(v: Any) -> tuple[Rejected, ...]:
    if not isinstance(v, list | tuple):
        raise MalformedRecord(f"expected a list of rejections, got {v!r}")
    out = []
    for e in v:
        if isinstance(e, Rejected):
            out.append(e)
        elif isinstance(e, Mapping) and "step" in e:
            out.append(Rejected(_int(e["step"]), _str(e.get("reason", ""))))
        else:
            raise MalformedRecord(f"expected {{step, reason}}, got {e!r}")
    return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordBase:
    """Fields and JSON shape shared by every kind."""

    kind: ClassVar[str]
    t: float = _f(_float)

    def to_json(self) -> dict[str, Any]:
        """The record as the trainer writes it: kind, t, then the fields in declaration order."""
        out: dict[str, Any] = {"kind": self.kind}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.metadata.get("omit_none"):
                continue
            if f.name == "rejected":
                value = [{"step": r.step, "reason": r.reason} for r in value]
            elif f.name == "changes":
                value = [{"field": c.field, "old": c.old, "new": c.new} for c in value]
            elif isinstance(value, WarmStarted):
                value = value.to_json()
            out[f.name] = value
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Started(RecordBase):
    kind: ClassVar[str] = "started"
    resumed_from: int | None = _f(_optional(_int), None)  # the checkpoint step, None: scratch
    checkpoint: str | None = _f(_optional(_str), None)  # its URI
    rejected: tuple[Rejected, ...] = _f(_rejected, ())  # newest first
    step: int = _f(_int)
    total_steps: int | None = _f(_optional(_int), None)
    # the world size of a checkpoint resumed on another one ("resharded N->M", not bitwise)
    resharded_from: int | None = _f(_optional(_int), None, omit_none=True)
    # training settings changed at this resume (`resume.allow_changes`); None: none changed
    changes: tuple[Changed, ...] | None = _f(_optional(_changes), None, omit_none=True)
    # a job with `init_from`: the source and whether its parts were loaded; None: no init_from
    warm_start: WarmStarted | None = _f(_optional(_warm_start), None, omit_none=True)  # noqa: RUF009 (frozen)


@dataclass(frozen=True, slots=True, kw_only=True)
class Step(RecordBase):
    kind: ClassVar[str] = "step"
    step: int = _f(_int)
    loss: float | None = _f(_optional(_float), None)
    steps_per_s: float | None = _f(_optional(_float), None)
    durable_step: int | None = _f(_optional(_int), None)
    # the newest step the warm standby holds a copy of (trainer/saving/peer.py); None: no copy
    standby_step: int | None = _f(_optional(_int), None, omit_none=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class Saving(RecordBase):
    """A checkpoint of `step` has begun (the controller's watchdog times the save until its `durable`)."""

    kind: ClassVar[str] = "saving"
    step: int = _f(_int)


@dataclass(frozen=True, slots=True, kw_only=True)
class Section(RecordBase):
    """The training loop entered (`begin`) or left a stretch that is no step: an evaluation, a data
    reload (`with session.section("eval")`, HF's and Lightning's evaluations). The controller's watchdog
    does not time it as a step (a long evaluation is no hang); `watchdog.section_s` may bound it."""

    kind: ClassVar[str] = "section"
    name: str = _f(_str, "")
    begin: bool = _f(_bool)
    step: int = _f(_int)


@dataclass(frozen=True, slots=True, kw_only=True)
class Durable(RecordBase):
    kind: ClassVar[str] = "durable"
    step: int = _f(_int)


@dataclass(frozen=True, slots=True, kw_only=True)
class Notice(RecordBase):
    kind: ClassVar[str] = "notice"
    cloud: str = _f(_str, "")
    action: str = _f(_str, "")
    stop: bool = _f(_bool)  # false: a rebalance recommendation, training goes on
    deadline: float | None = _f(_optional(_float), None)


@dataclass(frozen=True, slots=True, kw_only=True)
class Stopping(RecordBase):
    kind: ClassVar[str] = "stopping"
    reason: str = _f(_str)
    step: int = _f(_int)
    save: bool | None = _f(_optional(_bool), None, omit_none=True)  # emergency checkpoint taken
    save_reason: str | None = _f(_optional(_str), None, omit_none=True)
    deadline: float | None = _f(_optional(_float), None, omit_none=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class Interval(RecordBase):
    kind: ClassVar[str] = "interval"
    seconds: float = _f(_float)  # checkpoint every this many seconds of training
    cost_s: float = _f(_float)  # what one checkpoint takes from the loop
    mtbf_s: float = _f(_float)  # seconds between reclaims it was chosen for
    measured: bool = _f(_bool, False)  # cost measured (else the estimate before any checkpoint)
    reason: str = _f(_str, "")


@dataclass(frozen=True, slots=True, kw_only=True)
class Hook(RecordBase):
    kind: ClassVar[str] = "hook"
    event: str = _f(_str)  # on_preempt | on_stop | on_complete
    command: str = _f(_str, "")
    code: int | None = _f(_optional(_int), None)  # None: killed at its timeout, not started, or skipped
    timed_out: bool = _f(_bool, False)
    duration_s: float = _f(_float, 0.0)
    timeout_s: float = _f(_float, 0.0)
    output: str = _f(_str, "")  # the tail of its stdout and stderr
    error: str = _f(_str, "")  # why it did not start, or was skipped


@dataclass(frozen=True, slots=True, kw_only=True)
class Exit(RecordBase):
    kind: ClassVar[str] = "exit"
    code: int = _f(_int)
    name: str | None = _f(_optional(_str), None)  # the trainer's ExitCode name
    error: str = _f(_str, "")
    step: int | None = _f(_optional(_int), None)
    durable_step: int | None = _f(_optional(_int), None)


Record = Started | Step | Saving | Section | Durable | Notice | Stopping | Interval | Hook | Exit
KINDS: dict[str, type[Record]] = {
    c.kind: c for c in (Started, Step, Saving, Section, Durable, Notice, Stopping, Interval, Hook, Exit)
}


def to_json(record: Record) -> dict[str, Any]:
    """The JSON object of a record (see the module docstring for the shape)."""
    return record.to_json()


def build(kind: str, t: float, **values: Any) -> Record:
    """A record of `kind` from the trainer's own values, checked like a parsed one; MalformedRecord
    for an unknown kind or a bad value (a bug in the trainer, not input)."""
    cls = KINDS.get(kind)
    if cls is None:
        raise MalformedRecord(f"unknown status record kind {kind!r}")
    return _make(cls, {"t": t, **values})


def parse_record(obj: Any) -> Record | None:
    """The record in a JSON object, or None: not a record, an unknown kind, or malformed (logged)."""
    if not isinstance(obj, Mapping):
        return None
    cls = KINDS.get(obj.get("kind"))  # type: ignore[arg-type]
    if cls is None:
        return None
    try:
        return _make(cls, obj)
    except MalformedRecord as e:
        log.warning("ignoring a malformed %s status record: %s", cls.kind, e)
        return None


def _make(cls: type[Record], obj: Mapping[str, Any]) -> Record:
    values: dict[str, Any] = {}
    for f in fields(cls):
        if f.name in obj:
            values[f.name] = f.metadata["check"](obj[f.name])
        elif f.default is MISSING:
            raise MalformedRecord(f"{cls.kind} record without {f.name!r}")
    if isinstance(values.get("t"), float) and not math.isfinite(values["t"]):
        raise MalformedRecord(f"{cls.kind} record with time {values['t']!r}")
    return cls(**values)
