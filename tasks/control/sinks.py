"""Where the control loop reports: the `Sink` protocol, and `PlainSink` (no Prefect: log lines through
`logging`, events kept in a list) for tests and scripts; the flow passes
`tasks.reports.prefect_sink.PrefectSink`, which turns the same calls into Prefect task runs, events and
artifacts."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from spotrun.tasks.decisions.attempts import AttemptRecord

_T = TypeVar("_T")


class Sink(Protocol):
    """Where the control loop reports. Implementations: PlainSink (here) and PrefectSink."""

    def step(self, name: str, fn: Callable[..., _T], *args: Any) -> _T:
        """Run one step of the loop (`provision`, `train`, `check-checkpoints`): a Prefect task run."""
        ...

    def log(self, level: int, msg: str) -> None: ...

    def event(
        self, name: str, job: str, payload: dict[str, Any], labels: dict[str, str] | None = None
    ) -> None:
        """A `spotrun.*` event about the job (automations listen to them)."""
        ...

    def progress(self, job: str, step: int, total: int) -> None: ...

    def attempts(self, job: str, records: list[AttemptRecord]) -> None:
        """The attempts so far (an artifact on the flow run)."""
        ...

    def summary(self, job: str, markdown: str) -> None: ...


@dataclass
class PlainSink:
    """No Prefect: steps are plain calls, log lines go to `logging`, events are kept in `events`."""

    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("spotrun.control"))

    def step(self, name: str, fn: Callable[..., _T], *args: Any) -> _T:
        return fn(*args)

    def log(self, level: int, msg: str) -> None:
        self.logger.log(level, msg)

    def event(
        self, name: str, job: str, payload: dict[str, Any], labels: dict[str, str] | None = None
    ) -> None:
        self.events.append((name, {"job": job, **payload, **(labels or {})}))

    def progress(self, job: str, step: int, total: int) -> None:
        pass

    def attempts(self, job: str, records: list[AttemptRecord]) -> None:
        pass

    def summary(self, job: str, markdown: str) -> None:
        pass
