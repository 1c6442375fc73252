"""The worker's hooks: which one an attempt's ending fires, what its environment says, and its record.

Run by `python -m spotrun.trainer` after the attempt is over (trainer/__main__.py): the final, max-steps or
emergency checkpoint is durable, the storage lease given back (a replacement may already resume), and
only the exit record is left to write. So a hook never delays the emergency checkpoint; `on_preempt`'s
timeout is what the notice leaves (less EXIT_RESERVE_S for the exit record), at most `timeout_s`.

    exit code        ending                                                   hook
    0  COMPLETED     the job completed                                        on_complete
    75 PREEMPTED     a cloud notice, or a SIGTERM the provider declared a     on_preempt
                     reclaim's (--sigterm-window-s): the stop has a deadline
    75 PREEMPTED     any other stop request: SIGTERM (a controller stop or    on_stop
                     cancel, `kill`), SIGINT (Ctrl-C)
    4  STOPPED       --max-steps reached                                      on_stop
    1, 2, 3, 5, 6    crashed, config error, diverged, lease held or lost      none (on_attempt_end sees them)
    killed           SIGKILL, a reclaim without notice                        none (on_attempt_end sees them)

A SIGTERM carries no sender: locally the spot simulator's notice and a controller's stop are both one;
SPOTRUN_CAUSE names what the trainer saw, and `on_attempt_end` gets the controller's classification.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

from spotrun.trainer.checkpoint.format import checkpoint_uri
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.hooks.runner import HookRun, run_hook
from spotrun.trainer.preemption.requests import StopRequest
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.telemetry.records import Notice, Record, Stopping
from spotrun.trainer.telemetry.status import StatusReporter

log = logging.getLogger(__name__)

EXIT_RESERVE_S = 1.0  # of a notice's time left: the exit record and the process's end after the hook
MAX_STEPS_CAUSE = "max-steps"


@dataclass(frozen=True)
class Ending:
    """How the attempt ended, as the hooks see it."""

    code: ExitCode
    step: int | None  # the step training reached
    durable_step: int | None  # the newest durable checkpoint
    reason: str  # the stop request's ("aws spot terminate notice", "SIGTERM", "SIGINT"), or ""
    deadline: float | None  # epoch seconds the machine goes away, when the stop said


def worker_event(code: ExitCode, deadline: float | None) -> str | None:
    """The hook an attempt's exit fires on the worker (None: none); the table in the module docstring."""
    if code is ExitCode.COMPLETED:
        return "on_complete"
    if code is ExitCode.STOPPED:
        return "on_stop"
    if code is ExitCode.PREEMPTED:
        return "on_preempt" if deadline is not None else "on_stop"
    return None


def hook_timeout(timeout_s: float, deadline: float | None, now: float) -> float:
    """`timeout_s`, or less when a notice's deadline leaves less (not positive: no time to run it)."""
    if deadline is None:
        return timeout_s
    return min(timeout_s, deadline - now - EXIT_RESERVE_S)


def hook_env(spec: JobSpec, ending: Ending, event: str, timeout_s: float) -> dict[str, str]:
    """The variables a worker hook gets, beside the trainer's own environment."""
    durable = ending.durable_step
    cause = {ExitCode.COMPLETED: "completed", ExitCode.STOPPED: MAX_STEPS_CAUSE}.get(
        ending.code, ending.reason
    )
    return {
        "SPOTRUN_HOOK_EVENT": event,
        "SPOTRUN_JOB": spec.name,
        "SPOTRUN_RUN_KEY": spec.run_key or "",
        "SPOTRUN_STORAGE": spec.storage,
        "SPOTRUN_CHECKPOINT": checkpoint_uri(spec.storage, durable) if durable is not None else "",
        "SPOTRUN_STEP": "" if ending.step is None else str(ending.step),
        "SPOTRUN_DURABLE_STEP": "" if durable is None else str(durable),
        "SPOTRUN_CAUSE": cause,
        "SPOTRUN_EXIT_CODE": str(int(ending.code)),
        "SPOTRUN_DEADLINE": "" if ending.deadline is None else f"{ending.deadline:.3f}",
        "SPOTRUN_HOOK_TIMEOUT_S": f"{timeout_s:g}",
    }


def run_worker_hook(
    spec: JobSpec, ending: Ending, *, environ: Mapping[str, str], reporter: StatusReporter
) -> HookRun | None:
    """Run the hook the ending fires, if the job sets one; report it as a `hook` status record."""
    event = worker_event(ending.code, ending.deadline)
    argv = spec.hooks.command(event) if spec.hooks is not None and event is not None else None
    if spec.hooks is None or event is None or argv is None:
        return None
    timeout_s = hook_timeout(spec.hooks.timeout_s, ending.deadline, time.time())
    env = {**environ, **hook_env(spec, ending, event, timeout_s)}
    log.info("running hook %s: %s (timeout %.1f s)", event, " ".join(argv), timeout_s)
    ran = run_hook(event, argv, env=env, timeout_s=timeout_s)
    (log.info if ran.ok else log.warning)("hook %s", ran.summary())
    reporter.emit("hook", **ran.as_dict())
    return ran


def ending_of(
    code: ExitCode, stop: StopRequest, seen: StopSeen, *, reporter: StatusReporter, sigterm_window_s: float
) -> Ending:
    """The attempt's ending from this process's stop request and what its status records said (a
    launcher's ranks see the notices); a SIGTERM with a known window (`--sigterm-window-s`) is a
    reclaim's notice, its deadline the end of the window."""
    deadline = stop.deadline or seen.deadline
    if deadline is None and stop.reason == "SIGTERM" and sigterm_window_s > 0 and stop.received_at:
        deadline = stop.received_at + sigterm_window_s
    reason = stop.reason or seen.reason
    return Ending(
        code, reporter.last_step, durable_step=reporter.last_durable, reason=reason, deadline=deadline
    )


class StopSeen:
    """The stop as the status records told it (a launcher's ranks watch the notices, not it): subscribed
    to the reporter, it keeps the last stopping record's reason and the earliest stopping deadline."""

    def __init__(self) -> None:
        self.reason = ""
        self.deadline: float | None = None

    def __call__(self, rec: Record) -> None:
        if isinstance(rec, Stopping):
            self.reason = rec.reason
        deadline = rec.deadline if isinstance(rec, Stopping | Notice) and getattr(rec, "stop", True) else None
        if deadline is not None and (self.deadline is None or deadline < self.deadline):
            self.deadline = deadline
