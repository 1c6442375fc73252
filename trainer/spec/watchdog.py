"""The job file's `watchdog:` section: how long a start-up, a step and a checkpoint save may take before
the controller declares the worker hung, kills it and retries (tasks/control/watchdog.py runs it,
tasks/decisions/watchdog.py calibrates it).

Each timeout is `max(floor, multiplier x p99)` of the job's measured times, or an explicit value. The
default floors are chosen so that a job never loses to a false kill what a hang would have cost: 30 s
for a step is half the local provider's 60 s heartbeat (a hung 5 ms-step job is caught twice as
fast without tuning), and a job whose steps are milliseconds and that wants a hang caught in seconds
lowers `step_floor_s` here (the e2e test uses 3 s: 3.05-3.24 s from the hang to the worker gone).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

SECTIONS = ("startup", "step", "save")


class LossSpikeRule(BaseModel):
    """A loss spike rolls the job back (tasks/decisions/anomaly.py): `patience` losses in a row above
    `factor` x the median of the `window` before them."""

    model_config = ConfigDict(extra="forbid")

    factor: float = Field(default=3.0, gt=1, description="a loss above this many times the recent median")
    window: int = Field(default=50, ge=5, description="how many recent losses the median is taken over")
    patience: int = Field(
        default=3, ge=1, description="this many such losses in a row (one noisy batch is no spike)"
    )
    skip: bool = Field(
        default=True,
        description="skip the data from the checkpoint gone back to up to the first spiked step "
        "(replaying those batches replays the spike); recorded as a trajectory change",
    )


class ThroughputRule(BaseModel):
    """A throughput collapse restarts the job on a fresh worker (its emergency checkpoint first)."""

    model_config = ConfigDict(extra="forbid")

    factor: float = Field(
        default=0.25, gt=0, lt=1, description="steps per second below this fraction of the attempt's median"
    )
    window_s: float = Field(default=60.0, gt=0, description="for this long (saves and evaluations excepted)")


class WatchdogOptions(BaseModel):
    """Timeouts for start-up (from `started` to the first step), one step and one checkpoint save,
    calibrated from the job's own measured times."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(default=True, description="false: only the provider's heartbeat timeout applies")
    multiplier: float = Field(
        default=20.0, ge=2, description="a timeout is this many times the measured p99 (above its floor)"
    )
    min_samples: int = Field(
        default=20,
        ge=5,
        description="the attempt's own times are used once it has this many; before that the job's history",
    )
    startup_floor_s: float = Field(default=60.0, gt=0, description="the shortest calibrated start-up timeout")
    step_floor_s: float = Field(default=30.0, gt=0, description="the shortest calibrated step timeout")
    save_floor_s: float = Field(default=120.0, gt=0, description="the shortest calibrated save timeout")
    startup_s: float | None = Field(
        default=None, gt=0, description="a fixed start-up timeout (no calibration); empty: calibrated"
    )
    step_s: float | None = Field(
        default=None, gt=0, description="a fixed step timeout (no calibration); empty: calibrated"
    )
    save_s: float | None = Field(
        default=None, gt=0, description="a fixed save timeout (no calibration); empty: calibrated"
    )
    section_s: float | None = Field(
        default=None,
        gt=0,
        description="the longest an evaluation (a `section` of the loop) may run; empty: not timed by "
        "the watchdog (the provider's heartbeat still applies)",
    )

    loss_spike: LossSpikeRule | None = Field(
        default=None,
        description="roll back to the checkpoint before a loss spike, and skip its data; empty: off",
    )
    throughput: ThroughputRule | None = Field(
        default=None, description="restart on a fresh worker when the step rate collapses; empty: off"
    )

    @model_validator(mode="after")
    def _fixed_or_floor(self) -> WatchdogOptions:
        for section in SECTIONS:
            fixed, floor = getattr(self, f"{section}_s"), f"{section}_floor_s"
            # a floor other than its default: a dumped spec (the worker's job.yaml) lists every field
            if fixed is not None and getattr(self, floor) != type(self).model_fields[floor].default:
                raise ValueError(
                    f"watchdog {section}_s fixes the timeout, so {section}_floor_s would never apply: "
                    "set one of them"
                )
        return self

    def floor(self, section: str) -> float:
        """The floor of `section` (startup, step, save)."""
        return float(getattr(self, f"{section}_floor_s"))

    def fixed(self, section: str) -> float | None:
        """The explicit timeout of `section`, or None: calibrated."""
        value = getattr(self, f"{section}_s")
        return None if value is None else float(value)
