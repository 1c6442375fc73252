"""The parts of a job spec for jobs that run again and again (scheduled retraining): a run key per slot,
a warm start from an earlier run, a promotion gate, and how many runs' checkpoints to keep.

A job with `run_key` is a series of job runs, one per key. The controller fills the key's templates once,
at the key's first flow run (tasks/retraining/run_keys.py), into a *resolved* spec: `run_key` literal,
`run_values` the values used, `args` filled, `storage` with `/<key>` appended, and `init_from.source` /
`promote.champion` the runs it picked. Every later flow run of the key (recover-job, a retry) gets the
same resolved spec back from SQL, so the trainer only ever sees a resolved one.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from spotrun.trainer.errors import ConfigError
from spotrun.trainer.spec.templating import placeholders

JOB_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
RUN_KEY = r"^[A-Za-z0-9][A-Za-z0-9_.=-]{0,63}$"  # one path component, safe in a storage key
LATEST_COMPLETED, BEST = "latest-completed", "best"


def key_problem(key: str) -> str | None:
    """Why a filled run key cannot name a run (None: it can)."""
    if re.match(RUN_KEY, key):
        return None
    return (
        f"run key {key!r} is not one path component of letters, digits and _.=- (at most 64, "
        "starting with a letter or digit); change run_key or --run-key"
    )


class RunSource(BaseModel):
    """A finished run another run starts from or is compared with, as the controller picked it."""

    model_config = ConfigDict(extra="forbid")

    job: str = Field(pattern=JOB_NAME, description="the source run's job")
    run_key: str | None = Field(default=None, description="the source's run key; none: an unkeyed job")
    storage: str = Field(description="the source run's storage (its final checkpoint is read from there)")
    step: int = Field(ge=0, description="the step COMPLETED.json recorded")
    job_run_id: str = Field(default="", description="the source's job run in the history database")
    version: str | None = Field(default=None, description="its registered model version, where known")


class WarmStart(BaseModel):
    """Start a new run's weights (and optionally optimizer state) from an earlier run's final checkpoint."""

    model_config = ConfigDict(extra="forbid")

    job: str = Field(pattern=JOB_NAME, description="the job whose run to start from (often this one)")
    which: str = Field(
        default=LATEST_COMPLETED,
        description="latest-completed: that job's newest completed run; best: the run its promotion alias "
        "holds; anything else: that run key",
    )
    parts: list[Literal["model", "optimizer"]] = Field(
        default_factory=lambda: ["model"],  # type: ignore[arg-type]  # a list of the Literal
        description="what to load: [model], or [model, optimizer] (state only: this run's schedule and "
        "learning rates stand)",
    )
    on_missing: Literal["fresh", "refuse"] = Field(
        default="fresh",
        description="no valid source (the first night): fresh = start from scratch with a warning; refuse "
        "= fail in one line",
    )
    source: RunSource | None = Field(
        default=None, description="filled by spotrun at the run's first flow run: the run picked; leave empty"
    )

    @field_validator("parts")
    @classmethod
    def _model_first(cls, v: list[str]) -> list[str]:
        if "model" not in v:
            raise ValueError("parts must include model (optimizer state without its weights means nothing)")
        return sorted(set(v), key=["model", "optimizer"].index)

    @field_validator("which")
    @classmethod
    def _which_form(cls, v: str) -> str:
        if v not in (LATEST_COMPLETED, BEST) and (problem := key_problem(v)):
            raise ValueError(f"use latest-completed, best or a run key: {problem}")
        return v


class Promotion(BaseModel):
    """Move a model alias to the new version only if it beats the version the alias holds."""

    model_config = ConfigDict(extra="forbid")

    metric: str = Field(
        default="eval_loss",
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="a metric the recipe's evaluate() returns",
    )
    mode: Literal["min", "max"] = Field(default="min", description="min: lower is better; max: higher")
    alias: str = Field(
        default="champion", pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,63}$", description="the MLflow model alias"
    )
    better_by: float = Field(
        default=0.0, ge=0, description="the margin the new version must win by (in the metric's units)"
    )
    champion: RunSource | None = Field(
        default=None,
        description="filled by spotrun at the run's first flow run: the run the alias held, evaluated on "
        "this run's data beside the new model; leave empty",
    )


def check_run_key_template(v: str | None) -> str | None:
    """A `run_key` as written: placeholders from the vocabulary only, and not itself."""
    if v is not None:
        try:
            placeholders(v)
        except ConfigError as e:  # pydantic reports a ValueError as this field's error
            raise ValueError(str(e).removeprefix("template: ")) from None
        if "{run_key}" in v:
            raise ValueError(
                "run_key cannot use {run_key}; use {scheduled_date}, {scheduled_time} or {flow_run_name}"
            )
    return v


def keyed_problem(
    *, run_key: str | None, run_values: dict[str, str], keep_runs: int | None, args_templated: bool
) -> str | None:
    """Why these keyed-run fields do not go together (None: they do)."""
    if keep_runs is not None and run_key is None:
        return "keep_runs keeps the newest run keys: set run_key too, or remove keep_runs"
    if args_templated and run_key is None:
        return "args use {placeholders}, which are filled per run key: set run_key (e.g. {scheduled_date})"
    if run_values and run_key is not None:
        return key_problem(run_key)
    return None
