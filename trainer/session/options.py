"""What one training attempt is given (AttemptOptions, built once by the entry point) and what it returns
(AttemptResult), plus the seeding and device rules every attempt shares."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from spotrun.trainer.distributed.ranks import Ranks
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.preemption.handover import ANNOUNCE_S, Advert
from spotrun.trainer.preemption.requests import StopRequest
from spotrun.trainer.session.faults import Fault
from spotrun.trainer.session.resume import ResumeSource
from spotrun.trainer.spec.job import Change, JobSpec
from spotrun.trainer.storage import Storage
from spotrun.trainer.telemetry.status import StatusReporter


@dataclass(frozen=True)  # built once; what arrives later (the claimed storage) belongs to the session
class AttemptOptions:
    cache: Path  # local disk for checkpoint copies
    max_steps: int | None = None  # stop (with a checkpoint) after this many steps in this attempt
    metrics_path: Path | None = None  # per-step losses as JSON lines (float.hex, for exact comparisons)
    ranks: Ranks = field(default_factory=Ranks.solo)  # this process's place among the job's ranks
    stop: StopRequest = field(default_factory=StopRequest)
    resume_from: ResumeSource | None = None  # a specific checkpoint instead of the newest valid one
    fault: Fault | None = None  # injected failure (rehearsals, tests)
    # (resume step, N): resuming from that checkpoint, skip the data of N steps (a rollback's skip)
    skip_steps: tuple[tuple[int, int], ...] = ()
    mtbf_s: float | None = None  # `every: auto`: seconds between reclaims (the controller's estimate)
    # Take the job's storage for writing (its lease), once the model is built: a prewarmed trainer
    # does the slow part (imports, model, data) while the worker it replaces still saves.
    # `claim(peer)`: `peer` is where this trainer, waiting as a warm standby, takes copies of the
    # holder's state (trainer/saving/peer.py)
    claim: Callable[[Advert | None], Storage] | None = None
    prewarmed: bool = False  # started at another worker's notice: warm the first step's imports while waiting
    # Train through a notice for up to this long, until the replacement stands by
    # (trainer/preemption/handover.py); 0: stop at the next step. `worker_id`: this trainer's name in the
    # lease, which a standby names.
    handover_s: float = 0.0
    worker_id: str | None = None
    sigterm_window_s: float = 0.0  # a SIGTERM's warning before SIGKILL, when the provider knows it
    announce_s: float = ANNOUNCE_S  # how long a noticed trainer waits for its replacement's announcement
    reporter: StatusReporter = field(default_factory=StatusReporter)  # no stream: silent


@dataclass
class AttemptResult:
    code: ExitCode
    step: int
    resumed_from: int | None
    durable_step: int | None
    message: str = ""
    resharded_from: int | None = None  # the checkpoint's world size, when it differed from this run's
    changes: list[Change] = field(default_factory=list)  # trajectory changes allowed at this resume


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rank_seed(seed: int, rank: int) -> int:
    return (seed * 1_000_003 + rank * 7_919) % 2**63


def job_device(spec: JobSpec) -> torch.device:
    if spec.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: cuda requested but no CUDA device is visible; use device: auto or cpu")
    if spec.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec.device)
