"""Hooks (trainer/hooks/, tasks/control/hooks.py): the job file's `hooks:` validated at the edge, which
ending fires which hook, and the runner with real subprocesses: a hook that succeeds, fails, hangs (its
whole process group killed at its timeout) or cannot start is recorded, never raised."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from spotrun.tasks.control.hooks import HOOK_FAILED, HOOK_RAN, after_attempt
from spotrun.tasks.control.loop import PlainSink
from spotrun.tasks.decisions.attempts import AttemptRecord, Outcome
from spotrun.tasks.decisions.outcome import add_facts
from spotrun.tasks.providers.base import WatchResult
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.hooks.runner import run_hook
from spotrun.trainer.hooks.worker import Ending, hook_env, hook_timeout, worker_event
from spotrun.trainer.spec.job import JobSpec, parse_spec
from spotrun.trainer.telemetry.records import Hook, parse_record
from tests.procs import wait_gone

PY = sys.executable


def job(**fields: Any) -> JobSpec:
    return parse_spec({"name": "j", "recipe": "digits", "total_steps": 10, **fields})


# ---- the job file ----


def test_a_hook_is_an_argv_and_a_string_splits_like_a_shell() -> None:
    hooks = job(hooks={"on_stop": "python notify.py --msg 'a b'", "on_complete": ["sh", "-c", "x {y}"]}).hooks
    assert hooks is not None
    assert hooks.on_stop == ["python", "notify.py", "--msg", "a b"]
    assert hooks.on_complete == ["sh", "-c", "x {y}"]  # braces passed as written: no placeholders
    assert hooks.timeout_s == 60 and hooks.commands() == {
        "on_stop": hooks.on_stop,
        "on_complete": hooks.on_complete,
    }


@pytest.mark.parametrize(
    ("hooks", "message"),
    [
        ({"on_preempt": []}, "field 'hooks.on_preempt': the hook's command is empty: give the program"),
        ({"on_stop": "  "}, "field 'hooks.on_stop': the hook's command is empty"),
        (
            {"on_complete": "python 'x"},
            "does not split into arguments (No closing quotation); fix its quotes",
        ),
        (
            {"on_stop": ["x"], "timeout_s": 0},
            "field 'hooks.timeout_s': timeout_s 0 is not positive: give the",
        ),
        ({"on_stop": ["x"], "timeout_s": -5}, "timeout_s -5 is not positive"),
        ({"on_exit": ["x"]}, "field 'hooks.on_exit'"),
    ],
)
def test_bad_hooks_are_one_line(hooks: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        job(hooks=hooks)
    assert message in str(e.value) and "\n" not in str(e.value)


# ---- which ending fires which hook ----


@pytest.mark.parametrize(
    ("code", "deadline", "event"),
    [
        (ExitCode.COMPLETED, None, "on_complete"),
        (ExitCode.PREEMPTED, 1e9, "on_preempt"),  # a notice (or a SIGTERM with a declared window)
        (ExitCode.PREEMPTED, None, "on_stop"),  # a bare SIGTERM (a controller stop), Ctrl-C
        (ExitCode.STOPPED, None, "on_stop"),  # --max-steps
        (ExitCode.CRASHED, None, None),
        (ExitCode.CONFIG_ERROR, None, None),
        (ExitCode.DIVERGED, None, None),
        (ExitCode.LEASE_HELD, None, None),
        (ExitCode.LEASE_LOST, None, None),
    ],
)
def test_worker_event(code: ExitCode, deadline: float | None, event: str | None) -> None:
    assert worker_event(code, deadline) == event


def test_on_preempt_gets_what_the_notice_leaves() -> None:
    assert hook_timeout(60, None, now=100) == 60
    assert hook_timeout(60, 130, now=100) == 29  # less a second for the exit record
    assert hook_timeout(5, 130, now=100) == 5
    assert hook_timeout(60, 100.5, now=100) <= 0  # none left: skipped, and recorded so


def test_the_worker_hooks_environment() -> None:
    spec = job(storage="/ckpt/j")
    ending = Ending(
        ExitCode.PREEMPTED, 42, durable_step=42, reason="aws spot terminate notice", deadline=1234.5
    )
    env = hook_env(spec, ending, "on_preempt", 9.0)
    assert env == {
        "SPOTRUN_HOOK_EVENT": "on_preempt",
        "SPOTRUN_JOB": "j",
        "SPOTRUN_RUN_KEY": "",
        "SPOTRUN_STORAGE": "/ckpt/j",
        "SPOTRUN_CHECKPOINT": "/ckpt/j/step_000000042",
        "SPOTRUN_STEP": "42",
        "SPOTRUN_DURABLE_STEP": "42",
        "SPOTRUN_CAUSE": "aws spot terminate notice",
        "SPOTRUN_EXIT_CODE": "75",
        "SPOTRUN_DEADLINE": "1234.500",
        "SPOTRUN_HOOK_TIMEOUT_S": "9",
    }
    done = hook_env(
        spec, Ending(ExitCode.STOPPED, 5, durable_step=None, reason="", deadline=None), "on_stop", 60
    )
    assert (done["SPOTRUN_CAUSE"], done["SPOTRUN_CHECKPOINT"], done["SPOTRUN_DURABLE_STEP"]) == (
        "max-steps",
        "",
        "",
    )


# ---- the runner, with real subprocesses ----


def test_a_hook_that_succeeds_keeps_the_tail_of_its_output() -> None:
    code = "import os,sys; print('x' * 9000, flush=True); print(os.environ['SPOTRUN_JOB'], file=sys.stderr)"
    ran = run_hook("on_complete", [PY, "-c", code], env={"SPOTRUN_JOB": "j"}, timeout_s=30)
    assert ran.ok and ran.code == 0 and not ran.timed_out and ran.error == ""
    assert ran.output.endswith("x\nj\n") and len(ran.output) == 4000  # stdout and stderr, the tail
    assert 0 < ran.duration_s < 30 and "exit 0" in ran.summary()


def test_a_hook_that_fails_is_recorded() -> None:
    ran = run_hook("on_stop", [PY, "-c", "import sys; print('no bucket'); sys.exit(3)"], env={}, timeout_s=30)
    assert (ran.code, ran.timed_out, ran.ok) == (3, False, False) and ran.output == "no bucket\n"


def test_a_hook_that_hangs_is_killed_with_its_whole_group_at_its_timeout(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    script = f"{PY} -c 'import time; time.sleep(600)' & echo $! > {pid_file}; echo started; wait"
    t0 = time.monotonic()
    ran = run_hook("on_preempt", ["sh", "-c", script], env={"PATH": "/usr/bin:/bin"}, timeout_s=0.5)
    assert ran.timed_out and ran.code is None and ran.output == "started\n"
    assert 0.5 <= ran.duration_s < 5 and time.monotonic() - t0 < 5
    assert "killed at its 0.5 s timeout" in ran.summary()
    assert wait_gone(int(pid_file.read_text()), timeout=5)  # the hook's child went with it


def test_a_hook_that_cannot_start_or_has_no_time_is_recorded() -> None:
    ran = run_hook("on_stop", ["/nonexistent/hook"], env={}, timeout_s=5)
    assert ran.code is None and ran.error.startswith("cannot start:") and not ran.timed_out
    skipped = run_hook("on_preempt", [PY, "-c", "pass"], env={}, timeout_s=-1)
    assert skipped.error == "skipped: no time left" and skipped.code is None


# ---- the controller: the worker's record, on_attempt_end, events ----


def _record(**fields: Any) -> AttemptRecord:
    base: dict[str, Any] = {
        "attempt": 2,
        "worker_id": "local-1",
        "provider": "local",
        "started_at": 0.0,
        "ended_at": 1.0,
        "outcome": Outcome.PREEMPTED,
        "cause": "spot notice (SIGTERM), exited PREEMPTED",
        "exit_code": 75,
        "trainer_code": "PREEMPTED",
        "last_step": 30,
        "last_durable_step": 30,
    }
    return AttemptRecord(**(base | fields))


def test_the_workers_hook_record_reaches_the_row_and_an_event() -> None:
    line = Hook(t=1.0, event="on_preempt", command="x", code=2, duration_s=0.1, timeout_s=9, output="bad")
    rec = parse_record(line.to_json())
    assert rec == line
    result = WatchResult(started_at=0.0)
    result.fold(line)
    record = _record()
    add_facts(record, result, world_size=1)
    assert record.extra["hooks"] == [
        {
            "event": "on_preempt",
            "command": "x",
            "code": 2,
            "timed_out": False,
            "duration_s": 0.1,
            "timeout_s": 9.0,
            "output": "bad",
            "error": "",
        }
    ]
    sink = PlainSink()
    after_attempt(job(), record, sink, environ={})
    assert [(n, p["hook"], p["code"]) for n, p in sink.events] == [(HOOK_FAILED, "on_preempt", "2")]


def test_on_attempt_end_runs_with_the_attempt_in_its_environment() -> None:
    dump = (
        "import os; print(*(f'{k}={v}' for k, v in sorted(os.environ.items()) if k.startswith('SPOTRUN_')))"
    )
    hooks = {"on_attempt_end": [PY, "-c", dump], "on_stop": ["true"]}
    spec, record, sink = job(storage="/ckpt/j", hooks=hooks), _record(), PlainSink()
    secrets = {"PREFECT_API_AUTH_STRING": "s", "SPOTRUN_DATABASE_URL": "postgresql://u:p@h/db", "KEEP": "1"}
    after_attempt(spec, record, sink, environ=secrets)
    (ran,) = record.extra["hooks"]
    assert ran["event"] == "on_attempt_end" and ran["code"] == 0
    assert ran["output"].split() == [
        "SPOTRUN_ATTEMPT=2",
        "SPOTRUN_CAUSE=spot",
        "notice",
        "(SIGTERM),",
        "exited",
        "PREEMPTED",
        "SPOTRUN_CHECKPOINT=/ckpt/j/step_000000030",
        "SPOTRUN_DURABLE_STEP=30",
        "SPOTRUN_EXIT_CODE=75",
        "SPOTRUN_HOOK_EVENT=on_attempt_end",
        "SPOTRUN_HOOK_TIMEOUT_S=60",
        "SPOTRUN_JOB=j",
        "SPOTRUN_OUTCOME=preempted",
        "SPOTRUN_RUN_KEY=",
        "SPOTRUN_STEP=30",
        "SPOTRUN_STORAGE=/ckpt/j",
        "SPOTRUN_TRAINER_CODE=PREEMPTED",
        "SPOTRUN_WORKER_ID=local-1",
    ]  # the controller's secrets never reach it
    assert [(n, p["hook"]) for n, p in sink.events] == [(HOOK_RAN, "on_attempt_end")]


def test_on_attempt_end_that_hangs_is_killed_and_changes_nothing() -> None:
    spec = job(hooks={"on_attempt_end": [PY, "-c", "import time; time.sleep(600)"], "timeout_s": 0.3})
    record, sink = _record(), PlainSink()
    after_attempt(spec, record, sink, environ={})
    (ran,) = record.extra["hooks"]
    assert ran["timed_out"] and ran["code"] is None and record.outcome is Outcome.PREEMPTED
    assert [(n, p["timed_out"]) for n, p in sink.events] == [(HOOK_FAILED, True)]
