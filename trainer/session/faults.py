"""Fault injection for rehearsals and tests: `--inject-fault KIND@STEP[:RANK]`.

Fires right after optimizer step STEP completes, before any checkpoint due at that step, so
`sigkill@40` with checkpoints every 10 steps resumes from 30. Kinds:
  sigkill  the process dies at once (a spot reclaim with no notice, an OOM kill)
  sigterm  a notice: the loop finishes the step, checkpoints and exits PREEMPTED
  crash    an exception, as a bug in user code would raise
  hang     the process stops making progress (tests of heartbeat loss)
  slow     every step from STEP on takes SLOW_S longer (a throttled GPU: tests of the throughput rule)
  spike    the weights are scaled by SPIKE_SCALE: the loss jumps and stays up (tests of the watchdog's
           loss-spike rollback; the scaled state is what the rollback must not resume from)
With ranks, every rank fires unless `:RANK` names one (`sigkill@30:1`: rank 1 dies alone).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spotrun.trainer.errors import ConfigError

if TYPE_CHECKING:
    import torch

KINDS = ("sigkill", "sigterm", "crash", "hang", "slow", "spike")
SPIKE_SCALE = 30.0
SLOW_S = 0.1


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

    def maybe_fire(self, step: int, rank: int = 0, model: torch.nn.Module | None = None) -> None:
        if self.rank is not None and rank != self.rank:
            return
        if self.kind == "slow" and step >= self.step:
            time.sleep(SLOW_S)
        if step != self.step:
            return
        if self.kind == "spike" and model is not None:
            import torch  # only a spike needs it: a bad --inject-fault is refused before torch loads

            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(SPIKE_SCALE)
        if self.kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.kind == "crash":
            raise RuntimeError(f"injected crash at step {step}")
        elif self.kind == "hang":
            while True:
                time.sleep(3600)
