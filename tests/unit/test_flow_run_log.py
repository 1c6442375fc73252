"""What the flow run's log says about checkpoints: each durable checkpoint once, whether or not the
provider streams the trainer's own log (which says it with timings)."""

from __future__ import annotations

import base64
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from spotrun.tasks.control.loop import PlainSink, watch
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.telemetry.records import Durable

JOB = JobSpec(name="digits", recipe="digits", total_steps=100)
TRAINER_LINE = (
    "checkpoint step 25 durable in /store (snapshot 0.010s, write 0.02s, upload 0.00s, verify 0.00s)"
)


class Streams:
    """A provider whose watch replays `script`: ("log", line) or ("status", record)."""

    def __init__(self, *script: tuple[str, Any]) -> None:
        self.script = script

    def watch(self, worker: Any, on_status: Any, on_log: Any) -> Any:
        for kind, item in self.script:
            on_log(item) if kind == "log" else on_status(item)
        return None


@pytest.mark.parametrize(
    ("script", "lines"),
    [
        # local: the trainer's log reaches the flow run, and it already says so
        ((("log", "resuming from step 0"), ("log", TRAINER_LINE), ("status", Durable(step=25, t=0.0))), 1),
        # EC2: no trainer log reaches the controller; the status record is all there is
        ((("status", Durable(step=25, t=0.0)),), 1),
    ],
)
def test_each_durable_checkpoint_is_logged_once(
    script: tuple[tuple[str, Any], ...], lines: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    watch(Streams(*script), SimpleNamespace(id="local-1"), JOB, sink=PlainSink())  # type: ignore[arg-type]
    said = [r.getMessage() for r in caplog.records if "checkpoint step 25 durable" in r.getMessage()]
    assert len(said) == lines, said


def test_the_summary_shows_the_timeline_inline() -> None:
    from spotrun.tasks.reports.goodput import RunInfo, compute
    from spotrun.tasks.reports.reporting import summary_markdown

    png = b"\x89PNG\r\n\x1a\n" + bytes(range(40))
    rep = compute([], RunInfo("digits", "run-1", "completed", 12.0), now=12.0)
    md = summary_markdown(
        "digits", "completed", [], rep=rep, timeline="/home/me/.spotrun/digits/timeline.png", timeline_png=png
    )
    assert "- timeline: below; saved at `/home/me/.spotrun/digits/timeline.png`" in md
    inline = base64.b64encode(png).decode()
    assert md.endswith(f"![training step over wall time](data:image/png;base64,{inline})")
    assert "not saved" in summary_markdown("digits", "failed", [], rep=rep, timeline="")
