"""The local provider's settings and the spot simulator's plan: when each attempt is reclaimed, by a
schedule, random draws, or the replay of a capacity trace (tasks/providers/local/market.py)."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from spotrun.tasks.market.prices import Prices
from spotrun.tasks.market.traces import load
from spotrun.tasks.providers.trainer_env import trainer_env
from spotrun.trainer.checkpoint.signing import KEY_ENV
from spotrun.trainer.errors import ConfigError

if TYPE_CHECKING:
    from typing import Self

    from spotrun.trainer.spec.job import JobSpec


class PlannedPreemption(BaseModel):
    """One simulated reclaim of a worker."""

    model_config = ConfigDict(extra="forbid")

    after_s: float = Field(ge=0, description="seconds of training in the attempt before the reclaim")
    notice: bool = Field(
        default=True,
        description="send a notice (SIGTERM) and wait the notice window before the hard kill; "
        "false: a hard kill (SIGKILL) with no warning",
    )


class SpotSimulatorConfig(BaseModel):
    """When simulated spot reclaims happen. Explicit `schedule` entries first (entry i for attempt
    i+1), then random ones if `mean_interval_s` is set; with neither, workers are never reclaimed."""

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(default=0, ge=0, description="seed of the random reclaims (same seed, same times)")
    mean_interval_s: float | None = Field(
        default=None,
        gt=0,
        description="mean seconds of training between random reclaims (exponential inter-arrival, "
        "drawn per attempt); empty: only the schedule",
    )
    schedule: list[PlannedPreemption] = Field(
        default_factory=list,
        description="explicit reclaims: the first applies to attempt 1, the second to attempt 2, ...",
    )
    no_notice_fraction: float = Field(
        default=0.2, ge=0, le=1, description="share of random reclaims that come with no notice at all"
    )


class LocalProviderConfig(BaseModel):
    """Run workers as local subprocesses, with a simulated spot market."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["local"] = Field(default="local", description="the provider: local subprocesses")
    python: str | None = Field(
        default=None,  # not sys.executable: a default is baked into the deployment on the deploying machine
        description="Python interpreter that runs `python -P -m spotrun.trainer` (3.11+, torch and this "
        "project "
        "installed); empty: the one running the flow",
    )
    workdir: str | None = Field(
        default=None,
        description="directory for the workers' local checkpoint cache and metrics, one subdirectory "
        "per job; empty: .spotrun/local under the current directory",
    )
    heartbeat_timeout_s: float = Field(
        default=60,
        gt=0,
        description="once training has started, a worker that writes no line (status or log) for this "
        "long is killed and counted as lost",
    )
    prewarm: bool = Field(
        default=True,
        description="at a spot notice, start the next attempt's worker at once: it builds the recipe "
        "while the old one saves, and resumes as soon as that checkpoint is durable",
    )
    warm: int = Field(
        default=0,
        ge=0,
        le=1,
        description="standby workers kept for the job (0 or 1; more is not built yet): a trainer that has "
        "imported torch and built the recipe or entry point, started with each attempt and waiting on the "
        "storage lease; a reclaim without notice hands the job to it at once (tasks/control/warm.py). "
        "Needs prewarm",
    )
    warm_idle_s: float | None = Field(
        default=None,
        gt=0,
        description="a standby worker nobody used for this long is ended, and the attempt goes on "
        "without one (its cost is capped at this much of a second worker per attempt); empty: it stands "
        "by as long as the attempt runs",
    )
    fork_server: bool = Field(
        default=True,
        description="fork each trainer from a server process that has imported torch and the training "
        "stack once (seconds less per attempt: what a replacement after a reclaim without notice waits "
        "for); only when `python` is empty or the flow's own interpreter; false: every trainer is a fresh "
        "`python -m spotrun.trainer`",
    )
    pool: str | None = Field(
        default=None,
        description="share a fork server with every job on this host that names the same pool (a plain "
        "name: a-z, 0-9, '-'): a job's first trainer starts without the imports a private server pays "
        "for; it is started by the first job that needs it and outlives it (tasks/providers/local/pool.py)."
        " Needs fork_server; empty: a server per flow run",
    )
    pool_idle_s: float = Field(
        default=600,
        gt=0,
        description="a pool's server with no request and no trainer for this long ends (set by the job "
        "that starts it)",
    )
    startup_timeout_s: float = Field(
        default=600,
        gt=0,
        description="a worker that has not started training this long after launch (imports, checkpoint "
        "download and restore) is killed and counted as lost",
    )
    notice_s: float = Field(
        default=5,
        ge=0,
        description="seconds between a simulated notice (SIGTERM) and the hard kill (AWS gives 120)",
    )
    stop_grace_s: float = Field(
        default=20,
        ge=0,
        description="when the flow run is cancelled or interrupted (Ctrl-C): seconds the trainer gets after "
        "its SIGTERM to take an emergency checkpoint before SIGKILL; keep it under the 30 s a Prefect worker "
        "waits before it kills the flow process",
    )
    keep_cache: bool = Field(
        default=True,
        description="reuse the local checkpoint cache across attempts; false rehearses a fresh machine "
        "with an empty disk every attempt (each resume downloads from storage)",
    )
    simulator: SpotSimulatorConfig = Field(
        default_factory=SpotSimulatorConfig,
        description="when simulated spot reclaims happen: a schedule, random ones, or none",
    )
    trace: str | None = Field(
        default=None,
        description="replay a spot capacity trace (a file: one zone; a folder: a region, tasks/market/"
        "traces.py): a spot worker starts in a zone with capacity and gets a notice when that zone's "
        "capacity drops to 0; spot is refused while no zone has any; on-demand is always there. Not "
        "together with a simulator schedule or mean_interval_s",
    )
    zones: list[str] = Field(
        default_factory=list, description="the trace folder's zones to use; empty: all of them"
    )
    compress: float = Field(
        default=1.0,
        gt=0,
        description="replay speed: each trace tick lasts gap_seconds / compress of wall time",
    )
    trace_start_tick: int = Field(default=0, ge=0, description="the trace tick the replay begins at")
    spot_price_per_h: float = Field(
        default=0.918, ge=0, description="USD per hour of a spot worker on a trace (p3.2xlarge us-east-1)"
    )
    on_demand_price_per_h: float = Field(
        default=3.06,
        ge=0,
        description="USD per hour of an on-demand worker on a trace (p3.2xlarge, us-east-1)",
    )

    # What the controller asks of any provider's settings (tasks/providers/base.py ProviderSettings).
    workers_here: ClassVar[bool] = True

    @model_validator(mode="after")
    def _warm_needs_prewarm(self) -> LocalProviderConfig:
        if self.warm and not self.prewarm:
            raise ValueError(
                "warm workers hand over as a prewarmed replacement does: set prewarm: true, or warm: 0"
            )
        return self

    @model_validator(mode="after")
    def _pool_is_a_plain_name(self) -> LocalProviderConfig:
        if self.pool is None:
            return self
        why = pool_name_refusal(self.pool)
        if why is not None:
            raise ValueError(why)
        if not self.fork_server:
            raise ValueError("a pool shares a fork server: set fork_server: true, or leave pool out")
        return self

    @model_validator(mode="after")
    def _one_source_of_reclaims(self) -> LocalProviderConfig:
        if self.trace is None:
            if self.zones:
                raise ValueError("zones picks zones of a trace: set trace too, or leave zones out")
            return self
        if self.simulator.schedule or self.simulator.mean_interval_s is not None:
            raise ValueError(
                "set trace or a simulator schedule/mean_interval_s, not both: each decides when workers "
                "are reclaimed"
            )
        try:
            load(Path(self.trace), self.zones)
        except ConfigError as e:  # the trace's own one line, as a settings error
            raise ValueError(str(e)) from None
        return self

    def prices(self) -> Prices | None:
        """What an hour costs in a trace replay (its settings); None without a trace: nothing is priced."""
        return None if self.trace is None else Prices(self.spot_price_per_h, self.on_demand_price_per_h)

    def workers_dir(self, default: Path) -> Path:
        """`workdir` if set, else `default`."""
        return Path(self.workdir) if self.workdir else default

    def placed(self, workdir: Path) -> Self:
        """These settings with `workdir` set."""
        return self.model_copy(update={"workdir": str(workdir)})

    def endpoints(self) -> dict[str, str | None]:
        """None: local workers call no API."""
        return {}

    def deployment_refusal(self, is_loopback: Callable[[str], bool]) -> str | None:
        """None: nothing here is refused beyond what the trust check asks of every provider."""
        return None

    def signing_refusal(self, job: JobSpec, environ: Mapping[str, str]) -> str | None:
        """The key reaches the trainers through their environment, unless the job's `env` replaces it."""
        if trainer_env(environ, job.env).get(KEY_ENV) != environ.get(KEY_ENV):
            return f"{KEY_ENV} is set here but would not reach the trainers; leave it out of the job's env"
        return None


POOL_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,39}")


def pool_name_refusal(name: str) -> str | None:
    """None for a plain pool name; else the one line that refuses it (a deployment run may set it, and
    it names a file under $SPOTRUN_HOME/pools)."""
    if POOL_NAME.fullmatch(name):
        return None
    return (
        f"pool {name!r} is not a plain name: use 1-40 of a-z, 0-9 and '-', starting with a letter or a digit"
    )


def plan_preemption(cfg: SpotSimulatorConfig, attempt: int, rng: random.Random) -> PlannedPreemption | None:
    """The reclaim planned for `attempt` (1-based), or None if this attempt runs undisturbed."""
    if attempt <= len(cfg.schedule):
        return cfg.schedule[attempt - 1]
    if cfg.mean_interval_s is None:
        return None
    after_s = rng.expovariate(1 / cfg.mean_interval_s)
    notice = rng.random() >= cfg.no_notice_fraction
    return PlannedPreemption(after_s=after_s, notice=notice)


def simulator_rng(seed: int, attempt: int) -> random.Random:
    """The simulator's generator for one attempt: the same plan for an attempt whatever ran before it."""
    return random.Random(f"spotrun-spot-simulator:{seed}:{attempt}")
