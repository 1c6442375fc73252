"""The controller's side of a job's hooks: each attempt's hooks reach an event, and `on_attempt_end` runs.

The control loop calls `after_attempt` once an attempt is classified, before its row is stored: the
hook the worker ran (its `hook` status record, already in the row's `extra.hooks` by
tasks/decisions/outcome.py) becomes a `spotrun.hook.*` event, and `on_attempt_end`, when the job sets
one, runs here with the attempt's outcome, cause, step and job in its environment, the same runner and
timeout as the worker's (trainer/hooks/runner.py), recorded the same way. A hook that fails or hangs is
recorded and changes nothing: the policy decides on the attempt's own ending.

The hook gets the controller's environment less its secrets (`never_passed`: the Prefect auth string,
database URLs, Slack and AWS keys), as a trainer does. It blocks the loop for at most `timeout_s`; a
replacement prewarmed at a notice is already starting meanwhile.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, Protocol

from spotrun.tasks.decisions.attempts import AttemptRecord
from spotrun.trainer.checkpoint.format import checkpoint_uri
from spotrun.trainer.hooks.runner import run_hook
from spotrun.trainer.spec.job import JobSpec, never_passed

HOOK_RAN = "spotrun.hook.ran"  # exit 0
HOOK_FAILED = "spotrun.hook.failed"  # a non-zero exit, killed at its timeout, or could not start
OUTPUT_IN_EVENT = 1000  # characters of the output's tail an event carries (the row keeps all of it)


class HookSink(Protocol):
    """What this reports through (tasks/control/loop.py's Sink is one)."""

    def log(self, level: int, msg: str) -> None: ...

    def event(
        self, name: str, job: str, payload: dict[str, Any], labels: dict[str, str] | None = None
    ) -> None: ...


def attempt_env(job: JobSpec, record: AttemptRecord, timeout_s: float) -> dict[str, str]:
    """The variables `on_attempt_end` gets, beside the controller's environment less its secrets."""
    durable = record.last_durable_step
    return {
        "SPOTRUN_HOOK_EVENT": "on_attempt_end",
        "SPOTRUN_JOB": job.name,
        "SPOTRUN_RUN_KEY": job.run_key or "",
        "SPOTRUN_STORAGE": job.storage,
        "SPOTRUN_ATTEMPT": str(record.attempt),
        "SPOTRUN_WORKER_ID": record.worker_id,
        "SPOTRUN_OUTCOME": record.outcome.value,
        "SPOTRUN_CAUSE": record.cause,
        "SPOTRUN_STEP": str(record.last_step),
        "SPOTRUN_DURABLE_STEP": "" if durable is None else str(durable),
        "SPOTRUN_CHECKPOINT": "" if durable is None else checkpoint_uri(job.storage, durable),
        "SPOTRUN_EXIT_CODE": "" if record.exit_code is None else str(record.exit_code),
        "SPOTRUN_TRAINER_CODE": record.trainer_code or "",
        "SPOTRUN_HOOK_TIMEOUT_S": f"{timeout_s:g}",
    }


def after_attempt(
    job: JobSpec, record: AttemptRecord, sink: HookSink, environ: Mapping[str, str] | None = None
) -> None:
    """Report the worker's hook, then run `on_attempt_end` and record it in `record.extra["hooks"]`."""
    for ran in record.extra.get("hooks", []):
        _report(job, record, ran, sink)
    argv = job.hooks.command("on_attempt_end") if job.hooks is not None else None
    if job.hooks is None or argv is None:
        return
    timeout_s = job.hooks.timeout_s
    given = os.environ if environ is None else environ
    env = {k: v for k, v in given.items() if not never_passed(k)} | attempt_env(job, record, timeout_s)
    ran = run_hook("on_attempt_end", argv, env=env, timeout_s=timeout_s).as_dict()
    record.extra.setdefault("hooks", []).append(ran)
    _report(job, record, ran, sink)


def _report(job: JobSpec, record: AttemptRecord, ran: Mapping[str, Any], sink: HookSink) -> None:
    ok = ran.get("code") == 0
    code = ran.get("code")
    how = (
        ran.get("error")
        or (f"killed at its {ran.get('timeout_s', 0):g} s timeout" if ran.get("timed_out") else "")
        or f"exit {code}"
    )
    sink.log(
        logging.INFO if ok else logging.WARNING,
        f"attempt {record.attempt}: hook {ran.get('event')} ({ran.get('command')}): {how} "
        f"after {float(ran.get('duration_s', 0.0)):.2f} s",
    )
    payload = {
        "attempt": record.attempt,
        "hook": str(ran.get("event", "")),
        "command": str(ran.get("command", "")),
        "code": "" if code is None else str(code),  # strings: an automation renders them
        "timed_out": bool(ran.get("timed_out")),
        "duration_s": float(ran.get("duration_s", 0.0)),
        "output": str(ran.get("output", ""))[-OUTPUT_IN_EVENT:],
        "error": str(ran.get("error", "")),
    }
    sink.event(HOOK_RAN if ok else HOOK_FAILED, job.name, payload)
