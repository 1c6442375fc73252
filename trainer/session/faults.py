"""Fault injection for rehearsals and tests: `--inject-fault KIND@STEP[:RANK]`.

Fires right after optimizer step STEP completes, before any checkpoint due at that step, so
`sigkill@40` with checkpoints every 10 steps resumes from 30. Kinds:
  sigkill  the process dies at once (a spot reclaim with no notice, an OOM kill)
  sigterm  a notice: the loop finishes the step, checkpoints and exits PREEMPTED
  crash    an exception, as a bug in user code would raise
  hang     the process stops making progress (tests of heartbeat loss)
With ranks, every rank fires unless `:RANK` names one (`sigkill@30:1`: rank 1 dies alone).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from trainer.errors import ConfigError

KINDS = ("sigkill", "sigterm", "crash", "hang")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None  # None: every rank

    @classmethod
    def parse(cls, text: str) -> Fault:
        kind, _, at = text.partition("@")
        step, _, rank = at.partition(":")
        if kind not in KINDS or not step.isdigit() or int(step) < 1 or (rank and not rank.isdigit()):
            raise ConfigError(
                f"--inject-fault {text!r}: use KIND@STEP or KIND@STEP:RANK, KIND one of {', '.join(KINDS)}"
            )
        return cls(kind, int(step), int(rank) if rank else None)

    def maybe_fire(self, step: int, rank: int = 0) -> None:
        if step != self.step or (self.rank is not None and rank != self.rank):
            return
        if self.kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.kind == "crash":
            raise RuntimeError(f"injected crash at step {step}")
        elif self.kind == "hang":
            while True:
                time.sleep(3600)
