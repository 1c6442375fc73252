"""Status records (trainer/telemetry/records.py): the JSON lines stay exactly what they were before records
were typed, a newer trainer's extras are ignored, and a malformed record is refused rather than half-read."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from spotrun.trainer.telemetry.records import (
    Durable,
    Exit,
    MalformedRecord,
    Notice,
    Record,
    Rejected,
    Saving,
    Started,
    Step,
    Stopping,
    build,
    parse_record,
    to_json,
)
from spotrun.trainer.telemetry.status import PREFIX, StatusReporter, parse_status_line

# (record, its line as the trainer wrote it before records were typed)
LINES: list[tuple[Record, str]] = [
    (
        Started(
            t=1.5,
            resumed_from=40,
            checkpoint="s3://b/j/step_000000040",
            rejected=(Rejected(50, "manifest missing"),),
            step=40,
            total_steps=100,
        ),
        '{"kind":"started","t":1.5,"resumed_from":40,"checkpoint":"s3://b/j/step_000000040",'
        '"rejected":[{"step":50,"reason":"manifest missing"}],"step":40,"total_steps":100}',
    ),
    (
        Started(t=1.5, step=0, total_steps=9),
        '{"kind":"started","t":1.5,"resumed_from":null,"checkpoint":null,"rejected":[],"step":0,"total_steps":9}',
    ),
    (
        Step(t=2.0, step=5, loss=0.25, steps_per_s=3.125, durable_step=None),
        '{"kind":"step","t":2.0,"step":5,"loss":0.25,"steps_per_s":3.125,"durable_step":null}',
    ),
    (Saving(t=2.5, step=5), '{"kind":"saving","t":2.5,"step":5}'),
    (Durable(t=3.0, step=5), '{"kind":"durable","t":3.0,"step":5}'),
    (
        Notice(t=4.0, cloud="aws", action="terminate", stop=True, deadline=124.0),
        '{"kind":"notice","t":4.0,"cloud":"aws","action":"terminate","stop":true,"deadline":124.0}',
    ),
    (Stopping(t=5.0, reason="SIGTERM", step=6), '{"kind":"stopping","t":5.0,"reason":"SIGTERM","step":6}'),
    (
        Stopping(t=5.0, reason="aws terminate notice", step=6, save=True, save_reason="fits", deadline=9.0),
        '{"kind":"stopping","t":5.0,"reason":"aws terminate notice","step":6,"save":true,'
        '"save_reason":"fits","deadline":9.0}',
    ),
    (
        Exit(t=6.0, code=75, name="PREEMPTED", error="", step=6, durable_step=5),
        '{"kind":"exit","t":6.0,"code":75,"name":"PREEMPTED","error":"","step":6,"durable_step":5}',
    ),
]


@pytest.mark.parametrize(("record", "line"), LINES, ids=[r.kind for r, _ in LINES])
def test_json_is_byte_compatible_and_round_trips(record: Record, line: str) -> None:
    assert json.dumps(to_json(record), separators=(",", ":")) == line
    assert parse_record(json.loads(line)) == record
    assert parse_status_line(PREFIX + line) == record


def test_the_reporter_writes_the_same_line() -> None:
    stream, seen = io.StringIO(), []
    reporter = StatusReporter(stream)
    reporter.subscribe(seen.append)
    reporter.emit("durable", step=5)
    reporter.emit("stopping", reason="SIGTERM", step=6)
    lines = stream.getvalue().splitlines()
    assert [parse_status_line(x) for x in lines] == seen
    assert lines[1] == PREFIX + f'{{"kind":"stopping","t":{seen[1].t},"reason":"SIGTERM","step":6}}'
    assert (reporter.last_durable, seen[0]) == (5, Durable(t=seen[0].t, step=5))


PARSE_CASES: list[tuple[str, Any, Record | None]] = [
    ("unknown field: ignored", {"kind": "durable", "t": 1, "step": 3, "sha": "x"}, Durable(t=1.0, step=3)),
    ("older trainer: defaults", {"kind": "exit", "t": 1, "code": 0}, Exit(t=1.0, code=0)),
    ("unknown kind", {"kind": "gpu-temp", "t": 1, "celsius": 80}, None),
    ("no kind", {"t": 1, "step": 3}, None),
    ("not an object", [1, 2], None),
    ("required field missing", {"kind": "durable", "t": 1}, None),
    ("no time", {"kind": "durable", "step": 3}, None),
    ("wrong type", {"kind": "step", "t": 1, "step": "7"}, None),
    ("bool is no step", {"kind": "durable", "t": 1, "step": True}, None),
    ("bad rejection", {"kind": "started", "t": 1, "step": 0, "rejected": ["x"]}, None),
    ("infinite time", {"kind": "durable", "t": float("inf"), "step": 3}, None),
]


@pytest.mark.parametrize(("case", "obj", "want"), PARSE_CASES, ids=[c[0] for c in PARSE_CASES])
def test_parse_record(case: str, obj: Any, want: Record | None) -> None:
    assert parse_record(obj) == want


def test_ordinary_output_is_no_record() -> None:
    assert parse_status_line("step 5 loss 0.2") is None
    assert parse_status_line(PREFIX + "{not json") is None


def test_build_refuses_what_the_trainer_must_not_write() -> None:
    with pytest.raises(MalformedRecord, match="unknown status record kind"):
        build("progress", 1.0, step=1)
    with pytest.raises(MalformedRecord, match="durable record without 'step'"):
        build("durable", 1.0)
