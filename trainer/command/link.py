"""The script's side of a `command:` job: what spotrun tells a script it runs, and what it reads back.

The trainer starts the command with these in its environment (docs/integrations.md):

    SPOTRUN_CHECKPOINT_DIR  where the script writes its checkpoints ({checkpoint_dir}); the newest valid
                            one is restored there before the start
    SPOTRUN_RESUME_STEP     the step restored, or empty on a first start
    SPOTRUN_TOTAL_STEPS     the job file's total_steps
    SPOTRUN_NOTICE_FILE     appears at a notice: JSON {"reason", "deadline"} (epoch seconds or null).
                            SPOTRUN_DEADLINE cannot reach a running process's environment; this file
                            carries it. The stop signal (SIGTERM unless the job file says) follows it.
    SPOTRUN_STOP_SIGNAL     the name of that signal (SIGTERM, or the job file's `stop_signal`)
    SPOTRUN_STEPS_FILE      the script may append one JSON line per optimizer step, {"step": N} with
                            "loss" (and "lr") where it has them: its progress, and the losses MLflow
                            gets exactly once and the resume-fidelity check compares (unless the
                            line says "compare": false); {"step": N, "section": "eval", "begin": true}
                            and then "begin": false around an evaluation (no step: the watchdog does
                            not take it for a hung one)

A callback (spotrun.integrations.*) or any script reads these through `CommandLink`; nothing here
imports torch or a framework.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

CHECKPOINT_DIR = "SPOTRUN_CHECKPOINT_DIR"
RESUME_STEP = "SPOTRUN_RESUME_STEP"
TOTAL_STEPS = "SPOTRUN_TOTAL_STEPS"
NOTICE_FILE = "SPOTRUN_NOTICE_FILE"
STEPS_FILE = "SPOTRUN_STEPS_FILE"
STOP_SIGNAL = "SPOTRUN_STOP_SIGNAL"  # the signal's name (SIGTERM unless the job file says `stop_signal`)


@dataclass
class CommandLink:
    """A script's link to the trainer that runs it; `CommandLink.from_env()` is None outside spotrun."""

    checkpoint_dir: Path
    resume_step: int | None
    total_steps: int | None
    notice_file: Path
    steps_file: Path
    stop_signal: str = "SIGTERM"

    def __post_init__(self) -> None:
        self._signalled = threading.Event()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> CommandLink | None:
        env = os.environ if environ is None else environ
        if CHECKPOINT_DIR not in env or NOTICE_FILE not in env or STEPS_FILE not in env:
            return None
        resume, total = env.get(RESUME_STEP, ""), env.get(TOTAL_STEPS, "")
        return cls(
            checkpoint_dir=Path(env[CHECKPOINT_DIR]),
            resume_step=int(resume) if resume.isdigit() else None,
            total_steps=int(total) if total.isdigit() else None,
            notice_file=Path(env[NOTICE_FILE]),
            steps_file=Path(env[STEPS_FILE]),
            stop_signal=env.get(STOP_SIGNAL) or "SIGTERM",
        )

    def catch_stop_signal(self) -> bool:
        """Turn the stop signal into a flag `stop_requested` reads, instead of the default death: the
        script then saves at its next step. Only from the main thread (signal handlers live there);
        elsewhere returns False and the notice file alone is polled."""

        def handler(_signum: int, _frame: FrameType | None) -> None:
            self._signalled.set()

        if threading.current_thread() is not threading.main_thread():
            return False
        signal.signal(signal.Signals[self.stop_signal], handler)
        return True

    @property
    def stop_requested(self) -> bool:
        """A notice (or the stop signal) has come: save at this step and stop."""
        return self._signalled.is_set() or self.notice_file.exists()

    def notice(self) -> dict[str, Any]:
        """The notice as the trainer wrote it: {"reason", "deadline"}; {} before one."""
        try:
            body = json.loads(self.notice_file.read_text())
        except (OSError, ValueError):
            return {"reason": "signal"} if self._signalled.is_set() else {}
        return body if isinstance(body, dict) else {}

    def report(
        self,
        step: int,
        loss: float | None = None,
        lr: float | None = None,
        *,
        compare: bool = True,
        **metrics: float,
    ) -> None:
        """One optimizer step done (its loss, learning rate and other values where the script has them).
        `compare=False`: the loss is right for MLflow but no other attempt computed the same value (a
        mean over a logging window that a resume cut short), so the resume-fidelity check skips it."""
        line: dict[str, Any] = {"step": int(step)}
        if not compare:
            line["compare"] = False
        if loss is not None and math.isfinite(float(loss)):
            line["loss"] = float(loss).hex()
        if lr is not None and math.isfinite(float(lr)):
            line["lr"] = float(lr).hex()
        for k, v in metrics.items():
            if isinstance(v, int | float) and math.isfinite(float(v)):
                line.setdefault("m", {})[str(k)] = float(v).hex()
        with self.steps_file.open("a") as f:
            f.write(json.dumps(line, separators=(",", ":")) + "\n")

    def section(self, name: str, *, begin: bool, step: int) -> None:
        """An evaluation (or another stretch that is no step) began or ended at `step`: the controller's
        watchdog does not take it for a hung step."""
        line = {"step": int(step), "section": str(name)[:64], "begin": bool(begin)}
        with self.steps_file.open("a") as f:
            f.write(json.dumps(line, separators=(",", ":")) + "\n")


def write_notice(path: Path, reason: str, deadline: float | None) -> None:
    """The trainer's half: the notice file, written whole (renamed into place)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"reason": reason, "deadline": deadline}))
    os.replace(tmp, path)


def read_steps(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The complete lines appended to the steps file since byte `offset`, parsed (a malformed line is
    skipped: the script's file is input, not trusted), and the offset to read from next."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    out = []
    for raw in data[:end].splitlines():
        try:
            line = json.loads(raw)
            step = line["step"]
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(step, int) and step >= 0:
            out.append(line)
    return out, offset + end
