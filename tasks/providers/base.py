"""The worker seam: provision a machine running one trainer attempt, watch it until it is gone, release it.

A provider knows how to start `python -m spotrun.trainer` somewhere and how that somewhere dies; it does not
judge the outcome (tasks/decisions/outcome.py does, from the `WatchResult` and the completion marker) and it
does not decide what happens next (tasks/decisions/policy.py). The caller owns cleanup:

    worker = provider.provision(job, attempt, spec_path, extra_args)
    try:
        result = provider.watch(worker, on_status, on_log)
    finally:
        provider.release(worker)          # always: also on cancellation or an exception in a callback
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

from spotrun.tasks.market.prices import Prices
from spotrun.trainer.telemetry.heartbeat import MAX_LOSSES
from spotrun.trainer.telemetry.records import (
    Durable,
    Exit,
    Hook,
    Interval,
    Notice,
    Record,
    Saving,
    Section,
    Started,
    Step,
    Stopping,
)

# What a worker is rented on. The controller's deadline policy (tasks/deadlines/) picks it per attempt;
# "spot" leaves the choice to the provider's own rules (AWS: its on_demand_after_* fallback).
Market = Literal["spot", "on-demand"]

if TYPE_CHECKING:
    from typing import Self

    from spotrun.trainer.spec.job import JobSpec

StatusCallback = Callable[[Record], None]
LogCallback = Callable[[str], None]


class NoticeKind(StrEnum):
    """Who ended an attempt on purpose (a reclaim, real or simulated)."""

    SIM_NOTICE = "sim-notice"  # the local simulator: SIGTERM, then SIGKILL after the notice window
    SIM_NO_NOTICE = "sim-no-notice"  # the local simulator: SIGKILL with no warning
    SIM_TRACE = "sim-trace"  # the local trace replay: the zone's capacity dropped (SIGTERM, then SIGKILL)
    SPOT_INTERRUPTION = "spot-interruption"  # the cloud's spot market took the instance


class KillReason(StrEnum):
    """Why the worker was killed rather than left to exit (values are stored in the attempts' extra)."""

    NOTICE_WINDOW = "notice-window"  # still running when the notice window ran out
    NO_NOTICE = "no-notice"  # a reclaim without notice
    LOST = "lost"  # silent past the heartbeat (or startup) timeout
    RELEASE = "release"  # release() while it ran: the controller gave it back
    STOP_GRACE = "stop-grace"  # the controller stopped it and the grace period ran out
    RECLAIMED = "reclaimed"  # the cloud reclaimed the instance (kill_detail: its reason code)
    INSTANCE_GONE = "instance-gone"  # the instance stopped or vanished for another reason (kill_detail)


class StopCause(StrEnum):
    """What made the controller stop a worker it was watching."""

    CANCEL = "cancel"  # a flow-run cancel or a Prefect worker shutdown (SIGTERM to the flow)
    INTERRUPT = "interrupt"  # Ctrl-C
    ERROR = "error"  # the controller itself failed (a callback raised)
    MARKET = "market"  # the market policy moves the job to another market (tasks/control/market.py)
    WATCHDOG = "watchdog"  # the progress watchdog's throughput rule moves the job to a fresh worker


class StopWorker(Exception):
    """Raised by a watch callback to end the attempt on purpose: the provider stops the worker as an
    interrupted watch does (its trainer's emergency checkpoint first) and re-raises."""

    def __init__(self, cause: StopCause, why: str) -> None:
        super().__init__(why)
        self.cause = cause


def stop_cause(e: BaseException) -> StopCause:
    """Why the controller stopped a worker, from what interrupted its watch."""
    if isinstance(e, StopWorker):
        return e.cause
    if isinstance(e, KeyboardInterrupt):
        return StopCause.INTERRUPT
    if type(e).__name__ == "TerminationSignal":  # Prefect's SIGTERM bridge: a cancel or a worker shutdown
        return StopCause.CANCEL
    return StopCause.ERROR


@dataclass(frozen=True)
class WarmSettings:
    """Standby workers a provider keeps for a job (tasks/control/warm.py), where it offers them: a
    provider's optional `warm` attribute. Local: a forked trainer on this host. EC2: an instance in
    another zone than the running worker where the subnets allow (aws/provider.py), billed at the spot
    price while it stands by. Either's trainer has built the recipe and waits on the storage lease."""

    size: int  # standby workers (0: none)
    idle_s: float | None = None  # a standby unused this long is ended (None: it stands by all attempt)


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
    market: Market = "spot"  # what it was rented on
    zone: str = ""  # where, when the provider knows (a trace replay's zone, an EC2 availability zone)
    # What the provider has seen so far; final once `watch` returned or was interrupted (a cancel or
    # Ctrl-C in the controller: the provider stops the trainer gracefully, then re-raises).
    result: WatchResult | None = field(default=None, repr=False, compare=False)


# WatchResult attribute holding the last record of each kind.
_SLOT = {
    "started": "started",
    "step": "progress",
    "saving": "saving",
    "section": "section",
    "durable": "durable",
    "notice": "notice",
    "stopping": "stopping",
    "interval": "interval",
    "hook": "hook",
    "exit": "exit",
}


@dataclass
class WatchResult:
    """What a provider saw of one attempt, from start to the worker being gone. Times are epoch seconds
    on the watcher's clock; step numbers come from the trainer's status records
    (trainer/telemetry/records.py)."""

    started_at: float  # the process started
    ended_at: float = 0.0  # the process was seen gone
    exit_code: int | None = None  # the process exit status; None when a signal ended it
    signal: int | None = None  # the signal that ended it
    # The last status record of each kind (`fold`).
    started: Started | None = None
    progress: Step | None = None
    saving: Saving | None = None
    section: Section | None = None  # the last section record (an evaluation begun or ended)
    durable: Durable | None = None
    notice: Notice | None = None
    stopping: Stopping | None = None
    interval: Interval | None = None  # the checkpoint interval `every: auto` settled on last
    hook: Hook | None = None  # the job's hook the ending fired on the worker (trainer/hooks/worker.py)
    exit: Exit | None = None
    facts: dict[str, dict[str, Any]] = field(default_factory=dict)  # the provider's own: "ec2", "cost", ...
    started_training_at: float | None = None  # the `started` record arrived
    last_step: int = 0  # highest step reported (step, stopping and exit records)
    last_durable_step: int | None = None  # newest checkpoint reported durable
    standby_step: int | None = None  # newest step the warm standby confirmed a copy of (saving/peer.py)
    durable_times: list[tuple[float, int]] = field(default_factory=list)  # (t, step) per durable record
    step_times: list[tuple[float, int]] = field(default_factory=list)  # (t, step) samples, oldest dropped
    # step -> loss of every step record seen (and of those a heartbeat carried): the lost attempt's
    # side of the resume-fidelity check where no metrics file has every step (tasks/tracking/fidelity.py)
    losses: dict[int, float] = field(default_factory=dict)
    notice_at: float | None = None  # a notice (SIGTERM) was delivered
    notice_kind: NoticeKind | None = None  # who ended it on purpose
    killed_at: float | None = None  # the worker was killed (by the provider, the cloud or release)
    kill_reason: KillReason | None = None
    kill_detail: str = ""  # the cloud's own words for the end ("Server.SpotInstanceTermination")
    lost: bool = False  # the heartbeat (or startup) timeout was hit and the worker killed
    silent_s: float | None = None  # with `lost`: seconds without a line (or without `started`)
    log_tail: str = ""  # the last lines of stdout and stderr, status lines excluded
    stopped_by: StopCause | None = None  # the controller stopped the worker
    # the controller's progress watchdog killed it (tasks/control/watchdog.py): the timeout that fired,
    # the silence it saw and the calibration numbers, as the attempt row's `extra.watchdog` stores them
    hung: dict[str, Any] | None = None

    def fold(self, rec: Record) -> None:
        """Take one trainer status record: the last of each kind, the highest step and durable step."""
        setattr(self, _SLOT[rec.kind], rec)
        if isinstance(rec, Step) and rec.loss is not None:
            self.add_losses({rec.step: rec.loss})
        step = getattr(rec, "step", None)
        if isinstance(step, int):
            self.last_step = max(self.last_step, step)
        if isinstance(rec, Step) and rec.standby_step is not None:
            self.standby_step = max(self.standby_step or 0, rec.standby_step)
        durable = rec.step if isinstance(rec, Durable) else getattr(rec, "durable_step", None)
        if isinstance(durable, int):
            self.last_durable_step = max(self.last_durable_step or 0, durable)

    def add_losses(self, losses: dict[int, float]) -> None:
        """Keep these steps' losses (the newest MAX_LOSSES steps)."""
        self.losses.update(losses)
        if len(self.losses) > MAX_LOSSES:
            for s in sorted(self.losses)[: len(self.losses) - MAX_LOSSES]:
                del self.losses[s]

    def records(self) -> list[Record]:
        """The last record of each kind, oldest first."""
        found: list[Record] = [r for s in _SLOT.values() if (r := getattr(self, s)) is not None]
        return sorted(found, key=lambda r: r.t)

    @property
    def resumed_from(self) -> int | None:
        """The checkpoint step the trainer started from (None: scratch or never started)."""
        return self.started.resumed_from if self.started is not None else None

    @property
    def rejected(self) -> list[tuple[int, str]]:
        """(step, reason) of each checkpoint the trainer passed over when it chose where to resume."""
        return [(r.step, r.reason) for r in self.started.rejected] if self.started is not None else []

    @property
    def start_step(self) -> int:
        """The step training began at in this attempt."""
        return self.started.step if self.started is not None else 0

    @property
    def trainer_code(self) -> str | None:
        """The trainer's own ExitCode name from its `exit` record, if it wrote one."""
        return self.exit.name if self.exit is not None else None

    @property
    def trainer_error(self) -> str:
        """The error text of the trainer's `exit` record ("RuntimeError: ..."), or ""."""
        return self.exit.error if self.exit is not None else ""


@runtime_checkable
class Provider(Protocol):
    """Start, watch and stop workers. Implementations: tasks/providers/local/provider.py (a spot simulator),
    tasks/providers/aws/provider.py (EC2 spot), aws/rehearsal.py, and tests/fakes/provider.py (scripted, no
    processes); one contract for all in tests/integration/test_provider_contract.py. Each kind is built
    from its settings (`ProviderSettings`) by the registry (tasks/providers/registry.py)."""

    name: str
    prewarm: bool  # start the next attempt's worker at a notice (tasks/control/prewarm.py)
    # and at a rebalance recommendation, standing by this long for the notice (None: not at one)
    rebalance_wait_s: float | None
    capacity_poll_s: float  # how often a market short of spot is asked again (tasks/control/market.py)
    heartbeat_timeout_s: float  # silence that makes a worker lost: the watchdog's figure before history
    prices: Prices | None  # an hour on each market, where the provider knows it (the budget check)

    def provision(
        self, job: JobSpec, attempt: int, spec_path: Path, extra_args: list[str], *, market: Market = "spot"
    ) -> Worker:
        """Start the trainer for `attempt` (1-based) on a fresh worker on `market`; raise ProvisionError
        if none (a spot market without capacity: retryable)."""
        ...

    def watch(
        self, worker: Worker, on_status: StatusCallback | None, on_log: LogCallback | None
    ) -> WatchResult:
        """Block until the worker is gone. Callbacks run in the calling thread; what they raise propagates."""
        ...

    def stop(self, worker: Worker, cause: StopCause) -> WatchResult:
        """The controller is going away before this worker's watch began (a Ctrl-C or a cancel right
        after provisioning): stop it as an interrupted watch does, so that the trainer's emergency
        checkpoint is not lost, and return what was seen (also left on `worker.result`)."""
        ...

    def release(self, worker: Worker) -> None:
        """Kill whatever is left of the worker. Idempotent; safe before, during and after `watch`."""
        ...

    def stop_leftovers(self, flow_run_id: str) -> list[str]:
        """After adopting a job run whose controller died: stop the workers that controller's flow run
        left which this provider can find from any host (EC2: by tag), and return their ids, the newest
        last; [] when it finds them no other way than the controller's pid file
        (tasks/ownership/adoption.py)."""
        ...


class ProviderSettings(Protocol):
    """What the controller asks of a provider's settings without knowing its kind (tasks/admission/trust.py,
    spotrun run): each kind's pydantic model implements it, and the registry names the models."""

    workers_here: ClassVar[bool]  # workers run this machine's interpreter and files (recipes checked here)

    @property
    def kind(self) -> str:
        """The registry's key: a Literal field that tells the kinds apart in a job's YAML and the UI."""
        ...

    @property
    def python(self) -> str | None:
        """The interpreter that runs `python -m spotrun.trainer` (None: the flow's own)."""
        ...

    def workers_dir(self, default: Path) -> Path:
        """Where this machine keeps the workers' local files (cache, metrics): the settings' own
        directory if they name one, else `default`."""
        ...

    def placed(self, workdir: Path) -> Self:
        """These settings with the workers' local files under `workdir` (unchanged for remote workers)."""
        ...

    def endpoints(self) -> dict[str, str | None]:
        """The URLs these settings make the controller call, by field (the trust check's input)."""
        ...

    def deployment_refusal(self, is_loopback: Callable[[str], bool]) -> str | None:
        """What these settings alone may not do in a deployment run whatever the host allows (one line
        naming the field and the fix), or None."""
        ...

    def signing_refusal(self, job: JobSpec, environ: Mapping[str, str]) -> str | None:
        """With the controller holding the manifest key (KEY_ENV): why these workers would not sign
        with it (one line naming the fix), or None."""
        ...


def stopped(provider: Provider, worker: Worker, cause: StopCause) -> WatchResult:
    """The result of a watch a callback ended (`StopWorker`): the provider's watch stops its worker itself
    when a callback raises, and keeps the result on the worker; else it is stopped here."""
    if worker.result is not None and worker.result.stopped_by is not None:
        return worker.result
    return provider.stop(worker, cause)
