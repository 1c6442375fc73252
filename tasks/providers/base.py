"""The worker seam: provision a machine running one trainer attempt, watch it until it is gone, release it.

A provider knows how to start `python -m trainer` somewhere and how that somewhere dies; it does not
judge the outcome (tasks/outcome.py does, from the `WatchResult` and the completion marker) and it does
not decide what happens next (tasks/policy.py). The caller owns cleanup:

    worker = provider.provision(job, attempt, spec_path, extra_args)
    try:
        result = provider.watch(worker, on_status, on_log)
    finally:
        provider.release(worker)          # always: also on cancellation or an exception in a callback
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from trainer.spec import JobSpec

StatusCallback = Callable[[dict[str, Any]], None]
LogCallback = Callable[[str], None]


class ProvisionError(Exception):
    """No worker could be started. `retryable`: capacity or a transient API error (try again, maybe
    elsewhere) rather than a setup the provider will never accept (a missing executable, bad config)."""

    def __init__(self, message: str, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass
class Worker:
    """One provisioned worker running one attempt."""

    id: str  # "local-12345", "i-0abc..."
    provider: str
    attempt: int
    started_at: float  # epoch seconds the trainer process was started
    handle: Any = field(default=None, repr=False, compare=False)  # the provider's own state
    # What the provider has seen so far; final once `watch` returned or was interrupted (a cancel or
    # Ctrl-C in the controller: the provider stops the trainer gracefully, then re-raises).
    result: WatchResult | None = field(default=None, repr=False, compare=False)


@dataclass
class WatchResult:
    """What a provider saw of one attempt, from start to the worker being gone. Times are epoch seconds
    on the watcher's clock; step numbers come from the trainer's status lines (trainer/status.py)."""

    started_at: float  # the process started
    ended_at: float = 0.0  # the process was seen gone
    exit_code: int | None = None  # the process exit status; None when a signal ended it
    signal: int | None = None  # the signal that ended it
    status: dict[str, dict[str, Any]] = field(default_factory=dict)  # last status record of each kind
    started_training_at: float | None = None  # the `started` record arrived
    last_step: int = 0  # highest step reported (step, stopping and exit records)
    last_durable_step: int | None = None  # newest checkpoint reported durable
    durable_times: list[tuple[float, int]] = field(default_factory=list)  # (t, step) per durable record
    step_times: list[tuple[float, int]] = field(default_factory=list)  # (t, step) samples, oldest dropped
    notice_at: float | None = None  # a notice (SIGTERM) was delivered
    notice_kind: str | None = None  # who ended it on purpose: "sim-notice", "sim-no-notice", ...
    killed_at: float | None = None  # the provider sent SIGKILL
    kill_reason: str | None = None  # "notice-window", "no-notice", "lost", "release"
    lost: bool = False  # the heartbeat (or startup) timeout was hit and the worker killed
    silent_s: float | None = None  # with `lost`: seconds without a line (or without `started`)
    log_tail: str = ""  # the last lines of stdout and stderr, status lines excluded
    stopped_by: str | None = None  # the controller stopped the worker: "cancel", "interrupt", "error"

    def fold(self, kind: str, rec: dict[str, Any]) -> None:
        """Take one trainer status record: the last of each kind, the highest step and durable step."""
        self.status[kind] = rec
        step = rec.get("step")
        if isinstance(step, int):
            self.last_step = max(self.last_step, step)
        durable = step if kind == "durable" else rec.get("durable_step")
        if isinstance(durable, int):
            self.last_durable_step = max(self.last_durable_step or 0, durable)

    @property
    def resumed_from(self) -> int | None:
        """The checkpoint step the trainer started from (None: scratch or never started)."""
        step = self.status.get("started", {}).get("resumed_from")
        return int(step) if step is not None else None

    @property
    def rejected(self) -> list[tuple[int, str]]:
        """(step, reason) of each checkpoint the trainer passed over when it chose where to resume."""
        entries = self.status.get("started", {}).get("rejected") or []
        return [
            (int(e["step"]), str(e.get("reason", ""))) for e in entries if isinstance(e, dict) and "step" in e
        ]

    @property
    def start_step(self) -> int:
        """The step training began at in this attempt."""
        return int(self.status.get("started", {}).get("step") or 0)

    @property
    def trainer_code(self) -> str | None:
        """The trainer's own ExitCode name from its `exit` record, if it wrote one."""
        name = self.status.get("exit", {}).get("name")
        return str(name) if name is not None else None

    @property
    def trainer_error(self) -> str:
        """The error text of the trainer's `exit` record ("RuntimeError: ..."), or ""."""
        return str(self.status.get("exit", {}).get("error") or "")


@runtime_checkable
class Provider(Protocol):
    """Start, watch and stop workers. Implementations: tasks/providers/local.py (a spot simulator) and
    tasks/providers/aws.py (EC2 spot)."""

    name: str

    def provision(self, job: JobSpec, attempt: int, spec_path: Path, extra_args: list[str]) -> Worker:
        """Start the trainer for `attempt` (1-based) on a fresh worker; raise ProvisionError if none."""
        ...

    def watch(
        self, worker: Worker, on_status: StatusCallback | None, on_log: LogCallback | None
    ) -> WatchResult:
        """Block until the worker is gone. Callbacks run in the calling thread; what they raise propagates."""
        ...

    def release(self, worker: Worker) -> None:
        """Kill whatever is left of the worker. Idempotent; safe before, during and after `watch`."""
        ...
