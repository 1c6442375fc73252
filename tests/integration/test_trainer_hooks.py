"""A job's hooks through a real `python -m spotrun.trainer` (trainer/hooks/): `on_preempt` starts only once
the emergency checkpoint is durable and, hung, is killed with its child at its timeout while the checkpoint
stands; `on_stop` at --max-steps; `on_complete` that fails is recorded and the job still completes."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from spotrun.trainer.checkpoint.catalog import list_checkpoints, read_latest
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.telemetry.status import parse_status_line
from tests.fakes.imds import FakeIMDS
from tests.integration.test_notice_save import train_until_notice
from tests.procs import wait_gone
from tests.trainer_runs import trainer, write_spec

# what every hook does first: one JSON line of its SPOTRUN_* variables and its start time; then it exits
# with the code given, or starts a child and hangs (the child's pid in the line)
HOOK = """\
import json, os, subprocess, sys, time
seen = {k: v for k, v in os.environ.items() if k.startswith("SPOTRUN_")}
seen["at"] = time.time()
if sys.argv[2] == "hang":
    seen["child"] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(seen) + "\\n")
print("hook says hello", flush=True)
if sys.argv[2] == "hang":
    time.sleep(600)
sys.exit(int(sys.argv[2]))
"""


def _hook(tmp_path: Path, behaviour: str) -> list[str]:
    script = tmp_path / "hook.py"
    script.write_text(HOOK)
    return [sys.executable, str(script), str(tmp_path / "hooks.jsonl"), behaviour]


def _seen(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "hooks.jsonl").read_text().splitlines()]


def test_a_hung_on_preempt_starts_after_the_durable_save_and_is_killed_at_its_timeout(tmp_path: Path) -> None:
    imds = FakeIMDS()
    hooks = {"on_preempt": _hook(tmp_path, "hang"), "on_stop": ["false"], "timeout_s": 1.5}
    try:
        t0 = time.monotonic()
        run = train_until_notice(
            tmp_path, imds, "aws", lambda: imds.interrupt(in_seconds=120), 25, fields={"hooks": hooks}
        )
        took = time.monotonic() - t0
    finally:
        imds.close()
    assert run.rc == ExitCode.PREEMPTED, run.stderr[-2000:]
    stopping, hook, exit_ = run.last("stopping"), run.last("hook"), run.last("exit")
    step = stopping["step"]
    # the emergency save is untouched by the hook: durable, committed, the latest, 0 steps lost
    assert stopping["save"] is True and exit_["durable_step"] == exit_["step"] == step
    assert read_latest(run.storage) == step and list_checkpoints(run.storage)[step].committed
    # the hook started only after the checkpoint was durable, and was killed at its timeout with its child
    (seen,) = _seen(tmp_path)
    assert seen["at"] >= [r for r in run.records if r["kind"] == "durable"][-1]["t"]
    assert hook["event"] == "on_preempt" and hook["timed_out"] is True and hook["code"] is None
    assert 1.5 <= hook["duration_s"] < 5 and hook["timeout_s"] == 1.5  # timeout_s: less than the notice's
    assert hook["output"] == "hook says hello\n" and wait_gone(seen["child"], timeout=5)
    assert [r["kind"] for r in run.records][-2:] == ["hook", "exit"] and took < 30
    assert seen["SPOTRUN_HOOK_EVENT"] == "on_preempt" and seen["SPOTRUN_CAUSE"] == "aws spot terminate notice"
    assert seen["SPOTRUN_STEP"] == seen["SPOTRUN_DURABLE_STEP"] == str(step)
    assert seen["SPOTRUN_CHECKPOINT"] == f"{tmp_path / 'store'}/step_{step:09d}"
    assert seen["SPOTRUN_EXIT_CODE"] == "75" and float(seen["SPOTRUN_DEADLINE"]) > seen["at"]
    assert "killed at its 1.5 s timeout" in run.stderr


def test_on_stop_at_max_steps_then_a_failing_on_complete(tmp_path: Path) -> None:
    hooks = {"on_stop": _hook(tmp_path, "0"), "on_complete": _hook(tmp_path, "3"), "on_preempt": ["false"]}
    spec = write_spec(tmp_path / "job.yaml", total_steps=14, hooks=hooks)
    store = str(tmp_path / "store")
    stopped = trainer(spec, store, tmp_path, "--max-steps", "7")
    assert stopped.returncode == ExitCode.STOPPED, stopped.stderr[-2000:]
    done = trainer(spec, store, tmp_path)
    assert done.returncode == ExitCode.COMPLETED, done.stderr[-2000:]  # a failing hook changes nothing
    hooks_seen = [_hook_record(r.stdout) for r in (stopped, done)]
    assert [(h["event"], h["code"], h["timed_out"]) for h in hooks_seen] == [
        ("on_stop", 0, False),
        ("on_complete", 3, False),
    ]
    assert all(h["output"] == "hook says hello\n" for h in hooks_seen)
    on_stop, on_complete = _seen(tmp_path)
    assert (on_stop["SPOTRUN_CAUSE"], on_stop["SPOTRUN_EXIT_CODE"], on_stop["SPOTRUN_STEP"]) == (
        "max-steps",
        "4",
        "7",
    )
    assert (on_complete["SPOTRUN_CAUSE"], on_complete["SPOTRUN_EXIT_CODE"]) == ("completed", "0")
    assert on_complete["SPOTRUN_CHECKPOINT"] == f"{store}/step_000000014"


def _hook_record(stdout: str) -> dict[str, Any]:
    (hook,) = [
        r.to_json() for line in stdout.splitlines() if (r := parse_status_line(line)) and r.kind == "hook"
    ]
    return hook
