"""A stop (SIGTERM) is always reported with a `stopping` record, wherever it lands: before the first
step, mid-epoch, or between two epochs (found by the provider contract suite: a SIGTERM at step 112 of
the digits job, 4 epochs of 28 batches, ended PREEMPTED with no `stopping` record)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from spotrun.trainer.preemption.requests import StopRequest
from spotrun.trainer.session.loop import AttemptOptions, run_attempt
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import open_storage
from spotrun.trainer.telemetry.records import Stopping
from spotrun.trainer.telemetry.status import StatusReporter, parse_status_line

BATCHES_PER_EPOCH = 28  # digits: 1,797 samples, batch 64, the last partial batch dropped


class StopAt:
    """A reporter stream that requests the stop when the record of `kind` for `step` goes by."""

    def __init__(self, stop: StopRequest, kind: str, step: int) -> None:
        self.stop, self.kind, self.step, self.out = stop, kind, step, io.StringIO()

    def write(self, line: str) -> int:
        rec = parse_status_line(line.rstrip("\n"))
        if rec is not None and rec.kind == self.kind and getattr(rec, "step", None) == self.step:
            self.stop.notice("SIGTERM")
        return self.out.write(line)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize(
    ("kind", "at"),
    [
        ("none", 0),  # requested before the first step
        ("step", 5),  # mid-epoch: seen at the step boundary
        # the last batch of epoch 0: its synchronous checkpoint reports durable after the loop looked
        # at the stop flag and before the epoch's iterator ends; the next epoch never starts
        ("durable", BATCHES_PER_EPOCH),
    ],
)
def test_every_stop_is_reported(tmp_path: Path, kind: str, at: int) -> None:
    spec = JobSpec.model_validate(
        {
            "name": "stops",
            "recipe": "digits",
            "args": {"hidden": 16},
            "total_steps": 200,
            "threads": 1,
            "checkpoint": {"every_steps": BATCHES_PER_EPOCH, "async_upload": False},
            "storage": str(tmp_path / "store"),
            "log_every": 1,
        }
    )
    stop = StopRequest()
    if kind == "none":
        stop.notice("SIGTERM")
    stream = StopAt(stop, kind, at)
    reporter = StatusReporter(stream, min_interval_s=0.0)  # type: ignore[arg-type]
    opts: dict[str, Any] = {"cache": tmp_path / "cache", "stop": stop, "reporter": reporter}
    result = run_attempt(spec, open_storage(spec.storage), AttemptOptions(**opts))
    records = [r for line in stream.out.getvalue().splitlines() if (r := parse_status_line(line))]
    stopping = [r for r in records if isinstance(r, Stopping)]
    assert len(stopping) == 1 and stopping[0].reason == "SIGTERM" and stopping[0].step == at
    assert result.code.name == "PREEMPTED" and result.durable_step == at
