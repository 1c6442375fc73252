"""A job's hooks: the user's own commands at the ends of an attempt (upload logs, evaluate, notify).

Worker hooks (`on_preempt`, `on_stop`, `on_complete`) run on the worker once the attempt's last
checkpoint is durable; `on_attempt_end` runs on the controller once the attempt is classified. Each is a
command as an argv list, like `command:` (a string is split as a shell would, `shlex.split`, and run
without one); `{...}` is passed as written, not filled: what a hook needs comes in its environment
(trainer/hooks/ names the variables). A hook is a command, so a deployment run's parameters may name it
only where the worker host's settings list it (tasks/admission/trust.py, under `commands`).

Validated here, at the edge: an empty command or a timeout that is not positive is one line naming the
field and the fix.
"""

from __future__ import annotations

import shlex
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

WORKER_EVENTS = ("on_preempt", "on_stop", "on_complete")
CONTROLLER_EVENTS = ("on_attempt_end",)
HookEvent = Literal["on_preempt", "on_stop", "on_complete", "on_attempt_end"]
DEFAULT_TIMEOUT_S = 60.0


class HookOptions(BaseModel):
    """Commands to run when an attempt ends, and how long each may take."""

    model_config = ConfigDict(extra="forbid")

    on_preempt: list[str] | None = Field(
        default=None,
        description="on the worker, after a notice or a reclaim's SIGTERM, once the emergency checkpoint is "
        "durable; its timeout is the notice's time left, at most timeout_s",
    )
    on_stop: list[str] | None = Field(
        default=None,
        description="on the worker, after a stop that is no reclaim: a controller stop or cancel, Ctrl-C, "
        "--max-steps",
    )
    on_complete: list[str] | None = Field(
        default=None, description="on the worker, once the job completed (final checkpoint durable)"
    )
    on_attempt_end: list[str] | None = Field(
        default=None, description="on the controller, after each attempt is classified, whatever its outcome"
    )
    timeout_s: float = Field(
        default=DEFAULT_TIMEOUT_S,
        description="seconds a hook may run before its whole process group is killed",
    )

    @field_validator("on_preempt", "on_stop", "on_complete", "on_attempt_end", mode="before")
    @classmethod
    def _argv(cls, v: Any) -> Any:
        if isinstance(v, str):  # `on_stop: python notify.py` reads as the argv a shell would make
            try:
                return shlex.split(v)
            except ValueError as e:
                raise ValueError(f"{v!r} does not split into arguments ({e}); fix its quotes") from None
        return v

    @field_validator("on_preempt", "on_stop", "on_complete", "on_attempt_end")
    @classmethod
    def _not_empty(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v or not v[0].strip()):
            raise ValueError(
                "the hook's command is empty: give the program and its arguments, e.g. "
                "[python, upload.py], or remove the hook"
            )
        return v

    @field_validator("timeout_s")
    @classmethod
    def _positive(cls, v: float) -> float:
        if not v > 0:
            raise ValueError(f"timeout_s {v:g} is not positive: give the seconds a hook may run, e.g. 60")
        return v

    def command(self, event: str) -> list[str] | None:
        """The argv of the hook for `event` (None: none set)."""
        argv: list[str] | None = getattr(self, event)
        return argv

    def commands(self) -> dict[str, list[str]]:
        """Every hook set, by event."""
        return {e: argv for e in (*WORKER_EVENTS, *CONTROLLER_EVENTS) if (argv := self.command(e))}
