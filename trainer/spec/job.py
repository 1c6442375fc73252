"""The job spec: one typed model shared by the trainer, the flow and the Prefect UI form.

Validated at the edge (`load_spec`); everything below receives a `JobSpec` and trusts it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from spotrun.trainer.errors import ConfigError
from spotrun.trainer.redact import redact_tree
from spotrun.trainer.spec.deadline import deadline_problem
from spotrun.trainer.spec.entrypoints import code_problem, command_problem, entrypoint_problem
from spotrun.trainer.spec.hooks import HookOptions
from spotrun.trainer.spec.messages import explain_errors
from spotrun.trainer.spec.runs import (
    JOB_NAME,
    Promotion,
    WarmStart,
    check_run_key_template,
    keyed_problem,
)
from spotrun.trainer.spec.templating import uses_templates
from spotrun.trainer.spec.watchdog import WatchdogOptions
from spotrun.trainer.storage import Storage, open_storage
from spotrun.trainer.storage.options import S3Options
from spotrun.trainer.storage.registry import backend_for

# The fields `shape_hash` covers: a checkpoint's identity as tools see it without building a recipe
# (`spotrun checkpoints --spec`). Unchanged since format 1, so old checkpoints keep their hash; an entry
# point job's hash covers its `entrypoint` too (`shape_fields`). Whether a checkpoint may be resumed is
# decided field by field by `spec_changes`, not by this hash.
SHAPE_FIELDS = ("recipe", "args", "batch_size", "world_size")
# The code a job runs, one way in each: exactly one of them is set (`_one_way_in`).
CODE_FIELDS = ("recipe", "entrypoint", "command")
# What a job's identity is made of, apart from the world size (`distributed.allow_reshard` decides that):
#   shape       must match to load: the recipe or entry point, and the args declared as shaping the
#               state (a recipe's `@recipe(shape_args=...)`, an entry point's `shape_args:`; none
#               declared: every arg counts as shape, to stay safe)
#   trajectory  changes the numbers, not the state's shapes: seed, batch_size, amp, the other args.
#               Resumable with `resume.allow_changes` (or the trainer's --allow-changes), recorded in
#               the checkpoint and reported; the run is no longer bitwise equal to an uninterrupted one.
# Everything else (total_steps, storage, checkpoint policy, workers, threads, device, ...) may change
# freely; total_steps moves a schedule that depends on it, which is how a run is extended.
TRAJECTORY_FIELDS = ("seed", "batch_size", "amp")


class CheckpointPolicy(BaseModel):
    """When to checkpoint and how many to keep."""

    model_config = ConfigDict(extra="forbid")

    every: Literal["auto"] | None = Field(
        default=None,
        description="auto: every sqrt(2 x cost x MTBF) seconds (Young/Daly), from measured checkpoint costs "
        "and the job's reclaim history; replaces every_steps and every_seconds",
    )
    every_steps: int | None = Field(default=100, ge=1, description="checkpoint every N optimizer steps")
    every_seconds: float | None = Field(
        default=None, gt=0, description="checkpoint every T seconds of training"
    )
    mtbf_prior_s: float = Field(
        default=7200.0,
        gt=0,
        description="with every: auto, seconds between reclaims assumed until the job has a history",
    )
    keep: int = Field(
        default=3, ge=2, description="verified checkpoints to keep (>= 2: the newest may be uploading)"
    )
    async_upload: bool = Field(default=True, description="serialize and upload in the background")
    standby_every_s: float | None = Field(
        default=None,
        gt=0,
        description="with a warm standby (provider warm: 1), send it a copy of the state this often, so "
        "that a reclaim without notice loses at most this much training; empty: no copies",
    )

    @model_validator(mode="after")
    def _some_trigger(self) -> CheckpointPolicy:
        if self.every == "auto":
            given = ("every_steps", "every_seconds")
            fixed = [f for f in given if f in self.model_fields_set and getattr(self, f) is not None]
            if fixed:
                raise ValueError(f"every: auto chooses the interval itself; remove {' and '.join(fixed)}")
            self.every_steps = self.every_seconds = None
            return self
        if self.every_steps is None and self.every_seconds is None:
            raise ValueError("set every_steps and/or every_seconds, or training would never checkpoint")
        return self


class PreemptionOptions(BaseModel):
    """Cloud interruption notices: which metadata service to watch and how to use the warning.

    A notice turns into a stop at the next step boundary with an emergency checkpoint, when the time
    left allows one (estimated from the state size and measured bandwidth); otherwise the trainer
    exits at once and the last durable checkpoint stands."""

    model_config = ConfigDict(extra="forbid")

    notice: Literal["aws", "gcp", "azure", "none"] = Field(
        default="none",
        description="cloud whose interruption notices to watch (AWS: 2 min, GCP and Azure: 30 s); "
        "none: only SIGTERM",
    )
    poll_s: float = Field(
        default=5.0, gt=0, description="seconds between metadata polls (at most 5: notices can be 30 s)"
    )
    endpoint: str | None = Field(
        default=None,
        description="metadata service base URL; default http://169.254.169.254 (AWS, Azure) or "
        "http://metadata.google.internal (GCP); $SPOTRUN_IMDS_ENDPOINT on the worker wins",
    )
    save_margin_s: float = Field(
        default=5.0,
        ge=0,
        description="safety margin (s): skip the emergency checkpoint unless it is estimated to be "
        "durable this long before the notice's deadline",
    )

    @field_validator("poll_s")
    @classmethod
    def _poll_often_enough(cls, v: float) -> float:
        if v > 5:
            raise ValueError(
                f"poll_s {v:g} is too slow: GCP and Azure give only 30 s of notice and AWS advises "
                "polling every 5 s; use a value in (0, 5]"
            )
        return v

    @field_validator("endpoint")
    @classmethod
    def _endpoint_form(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError(f"{v!r} is not an http(s) URL: use e.g. http://169.254.169.254")
        return v.rstrip("/") if v else v


class DistributedOptions(BaseModel):
    """Ranks and how they share the model. One worker runs torchrun with `nproc_per_node` ranks; with
    `nnodes` > 1 the provider starts that many workers and they meet at the first one."""

    model_config = ConfigDict(extra="forbid")

    nproc_per_node: int | Literal["auto"] = Field(
        default=1, description="ranks per machine; auto: one per visible GPU (1 on a CPU-only machine)"
    )
    nnodes: int = Field(default=1, ge=1, le=64, description="machines, each with nproc_per_node ranks")
    strategy: Literal["ddp", "fsdp"] = Field(
        default="ddp", description="ddp: a full replica per rank; fsdp: parameters sharded (FSDP2)"
    )
    backend: Literal["auto", "nccl", "gloo"] = Field(
        default="auto", description="auto: nccl on CUDA, gloo on CPU"
    )
    allow_reshard: bool = Field(
        default=False,
        description="resume a checkpoint written by another world size (same global batch; not bitwise)",
    )
    port: int = Field(default=29500, ge=1024, le=65535, description="rendezvous port on the first machine")

    @field_validator("nproc_per_node")
    @classmethod
    def _positive(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("use a number of ranks >= 1, or auto")
        return v

    def world_size(self, gpus: int = 0) -> int:
        """Ranks in all; `gpus`: GPUs visible on this machine (resolves `auto`)."""
        per_node = self.nproc_per_node if isinstance(self.nproc_per_node, int) else max(gpus, 1)
        return per_node * self.nnodes


class TrackingOptions(BaseModel):
    """Experiment tracking in MLflow and the resume-fidelity check. The controller talks to MLflow; the
    trainer never imports it (3-4 s), it only writes each step's metrics to storage once a checkpoint
    covers them (docs/tracking.md)."""

    # `register` is the name people write; as a field name it would shadow BaseModel.register (ABC's)
    model_config = ConfigDict(
        extra="forbid", validate_by_name=True, validate_by_alias=True, serialize_by_alias=True
    )

    mlflow: bool = Field(
        default=True,
        description="one MLflow run per job run: the spec as params, per-step loss/lr/steps_per_s once "
        "durable, preemptions, the resume checks and the final model",
    )
    uri: str | None = Field(
        default=None,
        description="tracking URI (http(s)://server, databricks, sqlite:///file.db); default "
        "$MLFLOW_TRACKING_URI, else the embedded sqlite:///$SPOTRUN_HOME/mlflow.db",
    )
    experiment: str | None = Field(default=None, description="MLflow experiment; default the job's name")
    register_model: bool = Field(
        default=True,
        alias="register",
        description="register the final weights and the spec as a new version of the model named after "
        "the job",
    )
    resume_rtol: float = Field(
        default=1e-3,
        ge=0,
        le=1,
        description="relative tolerance of a `close` resume check (steps computed twice differ by at "
        "most this much); beyond it: `mismatch`",
    )

    @field_validator("uri")
    @classmethod
    def _uri_form(cls, v: str | None) -> str | None:
        if v is not None and "://" not in v and not v.startswith("databricks"):
            raise ValueError(
                f"{v!r} is not a tracking URI: use http(s)://host:port, sqlite:///path or databricks"
            )
        return v


class ResumeOptions(BaseModel):
    """What a resume accepts beyond an identical job."""

    model_config = ConfigDict(extra="forbid")

    allow_changes: bool = Field(
        default=False,
        description="resume a checkpoint made with other training settings (seed, batch_size, amp, "
        "recipe args that do not shape the model): recorded in the checkpoint and the run's history, "
        "and the run is no longer bitwise equal to an uninterrupted one. Shape changes are always refused",
    )


# The controller's secrets: never in a trainer's environment, even when a job names them (the trainer
# never talks to Prefect, the history database, Slack or MLflow; its AWS access is its own profile or role).
NEVER_PASSED = frozenset(
    {
        "PREFECT_API_AUTH_STRING",
        "PREFECT_API_KEY",
        "SPOTRUN_DATABASE_URL",
        "DATABASE_URL",
        "PGPASSWORD",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_SECURITY_TOKEN",
        "AWS_CONTAINER_AUTHORIZATION_TOKEN",
        "MLFLOW_TRACKING_PASSWORD",
        "MLFLOW_TRACKING_TOKEN",
    }
)
NEVER_PASSED_PREFIXES = ("PREFECT_", "SPOTRUN_SLACK_", "SLACK_")
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"


def never_passed(name: str) -> bool:
    """Whether `name` is one of the controller's secrets (or looks like one: *_DATABASE_URL)."""
    upper = name.upper()
    return upper in NEVER_PASSED or upper.startswith(NEVER_PASSED_PREFIXES) or upper.endswith("_DATABASE_URL")


class EnvOptions(BaseModel):
    """The trainer's environment beyond spotrun's allow-list (PATH, PYTHONPATH, VIRTUAL_ENV, HF_HOME,
    CUDA_*, thread settings, ...): names to pass from the environment the worker starts from, and values
    to set. The controller's secrets never pass, even when named."""

    model_config = ConfigDict(
        extra="forbid", validate_by_name=True, validate_by_alias=True, serialize_by_alias=True
    )

    pass_: list[str] = Field(
        default_factory=list,
        alias="pass",
        description="variables passed from the environment a local worker starts from (e.g. HF_TOKEN); "
        "EC2 workers start from the instance's own environment",
    )
    set_: dict[str, str] = Field(
        default_factory=dict, alias="set", description="variables set in the trainer's environment"
    )

    @field_validator("pass_")
    @classmethod
    def _pass_names(cls, v: list[str]) -> list[str]:
        for name in v:
            _check_env_name(name)
        return v

    @field_validator("set_")
    @classmethod
    def _set_names(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            _check_env_name(name)
            if name.upper().startswith("SPOTRUN_"):
                raise ValueError(f"{name} is spotrun's own variable; set it where you start spotrun")
        return v


def _check_env_name(name: str) -> None:
    if not re.match(_ENV_NAME, name):
        raise ValueError(f"{name!r} is not a variable name: use letters, digits and _")
    if never_passed(name):
        raise ValueError(f"{name} is a controller secret, never given to trainers; remove it")


class JobSpec(BaseModel):
    """Everything needed to run (and re-run, bit for bit) one training job."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=JOB_NAME, description="job name, used in paths and alerts")
    recipe: str | None = Field(
        default=None,
        description="built-in recipe (digits, charlm) or package.module:function, a build(args, ctx) "
        "returning Parts; or else set entrypoint",
    )
    entrypoint: str | None = Field(
        default=None,
        description="package.module:function, your own training loop using spotrun.session(); called as "
        "main(args) if it takes an argument, else main(); or else set recipe. Note: not prefect.yaml's "
        "`entrypoint`, which names a flow",
    )
    command: list[str] | None = Field(
        default=None,
        description="an unchanged script, as argv: [python, train.py, --output_dir, '{checkpoint_dir}']; "
        "spotrun restores its newest valid checkpoint into {checkpoint_dir} first, publishes each one it "
        "writes there and forwards a notice (docs/integrations.md); or else set recipe or entrypoint",
    )
    stop_signal: Literal["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"] = Field(
        default="SIGTERM",
        description="with command: the signal a notice sends the script, after the notice file",
    )
    args: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments for the recipe, or the entry point's args"
    )
    shape_args: list[str] | None = Field(
        default=None,
        description="with entrypoint: the args that shape the state (model and optimizer structure), so "
        "changing another one is a change of trajectory; none: every arg is shape",
    )
    total_steps: int = Field(ge=1, description="optimizer steps to train")
    deadline: str | None = Field(
        default=None,
        description="when the job must be done: a time with its timezone (2026-12-07T08:00:00Z) or a "
        "duration from the job run's start, or a scheduled run's slot (12h, 90m, 2d); the market policy "
        "then buys on-demand only when spot would miss it",
    )
    budget_usd: float | None = Field(
        default=None, gt=0, description="the most the job may cost; refused at submission when too little"
    )
    max_wait_s: float | None = Field(
        default=None,
        gt=0,
        description="the longest the job waits for spot capacity, counted from the last failure; then "
        "on-demand",
    )
    seconds_per_step: float | None = Field(
        default=None,
        gt=0,
        description="your estimate of one step's time on a worker, for the deadline check before the job "
        "has history (it then uses the measured rate)",
    )
    market_policy: Literal["spotrun", "uniform-progress", "greedy", "on-demand"] = Field(
        default="spotrun",
        description="with a deadline: how spot and on-demand are chosen (docs/benchmarks.md compares them)",
    )
    batch_size: int = Field(
        default=64,
        ge=1,
        description="samples per optimizer step, per rank (the last partial batch is dropped)",
    )
    seed: int = Field(
        default=0,
        ge=0,
        description="seeds weight init, data order and the recipe's randomness: same seed, same run",
    )
    num_workers: int = Field(default=0, ge=0, le=64, description="data-loader worker processes")
    threads: int | None = Field(
        default=None, ge=1, description="torch intra-op threads; None: the checkpoint's count on resume"
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="where to train; auto: CUDA when the worker has a GPU, else the CPU"
    )
    amp: bool = Field(default=False, description="mixed precision with a GradScaler (CUDA)")
    distributed: DistributedOptions | None = Field(
        default=None,
        description="torchrun ranks (DDP or FSDP2, sharded checkpoints); none: one process",
    )
    checkpoint: CheckpointPolicy = Field(
        default_factory=CheckpointPolicy, description="when to checkpoint and how many to keep"
    )
    storage: str = Field(
        default="",
        description="directory, file:// URI or s3://bucket/prefix; a relative path is under SPOTRUN_HOME; "
        "empty: checkpoints/<name> there (one store per job: two jobs in one store refuse each other)",
    )
    s3: S3Options = Field(default_factory=S3Options, description="options for s3:// storage")
    preemption: PreemptionOptions = Field(
        default_factory=PreemptionOptions, description="cloud interruption notices"
    )
    log_every: int = Field(
        default=10, ge=1, description="log step, loss, learning rate and steps/s every this many steps"
    )
    tracking: TrackingOptions = Field(
        default_factory=TrackingOptions, description="MLflow tracking and the resume-fidelity check"
    )
    resume: ResumeOptions = Field(
        default_factory=ResumeOptions, description="which differences from a checkpoint's job to accept"
    )
    watchdog: WatchdogOptions = Field(
        default_factory=WatchdogOptions,
        description="how long a start-up, a step and a save may take before the worker counts as hung "
        "(killed and retried): max(floor, multiplier x p99) of the job's measured times, or fixed values",
    )
    env: EnvOptions = Field(
        default_factory=EnvOptions,
        description="the trainer's environment: names to pass beyond the allow-list, values to set",
    )
    hooks: HookOptions | None = Field(
        default=None,
        description="your commands when an attempt ends: on_preempt, on_stop, on_complete (on the worker), "
        "on_attempt_end (on the controller), timeout_s; docs/running.md#hooks",
    )
    # Jobs that run again and again (trainer/spec/runs.py): one job run per key.
    run_key: str | None = Field(
        default=None,
        description="one job run per key, filled per scheduled slot (e.g. {scheduled_date}); each key has "
        "its own storage prefix, history rows and MLflow run; none: one job run per job",
    )
    run_values: dict[str, str] = Field(
        default_factory=dict,
        description="filled by spotrun at the key's first flow run: the template values used; leave empty",
    )
    init_from: WarmStart | None = Field(
        default=None, description="warm start: load the model (and optimizer) from an earlier run first"
    )
    promote: Promotion | None = Field(
        default=None, description="move a model alias to this run's version only if it is better"
    )
    keep_runs: int | None = Field(
        default=None,
        ge=1,
        description="with run_key: keep the checkpoints of this many newest keys (plus runs in flight, the "
        "champion and a running warm start's source); older keys' prefixes are deleted; none: keep all",
    )

    @field_validator("recipe")
    @classmethod
    def _recipe_form(cls, v: str | None) -> str | None:
        if v is not None and (not v or (":" in v and (v.startswith(":") or v.endswith(":")))):
            raise ValueError("use a built-in name (digits, charlm) or 'package.module:function'")
        return v

    @field_validator("deadline")
    @classmethod
    def _deadline_form(cls, v: str | None) -> str | None:
        if v is not None and (problem := deadline_problem(v)):
            raise ValueError(problem)
        return v

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_form(cls, v: str | None) -> str | None:
        if v is not None and (problem := entrypoint_problem(v)):
            raise ValueError(problem)
        return v

    @field_validator("command")
    @classmethod
    def _command_form(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (problem := command_problem(v)):
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _one_way_in(self) -> JobSpec:
        if problem := code_problem({k: getattr(self, k) is not None for k in CODE_FIELDS}):
            raise ValueError(problem)
        if self.shape_args is not None and self.entrypoint is None:
            raise ValueError(
                "shape_args is for an entrypoint job; a recipe declares its own with "
                "@recipe(shape_args=...): remove shape_args"
            )
        return self

    @field_validator("run_key")
    @classmethod
    def _run_key_form(cls, v: str | None) -> str | None:
        return check_run_key_template(v)

    @model_validator(mode="after")
    def _keyed_fields(self) -> JobSpec:
        try:
            templated = not self.run_values and uses_templates(self.args, "args")
        except ConfigError as e:  # an unknown placeholder in args: the message names where
            raise ValueError(str(e)) from None
        problem = keyed_problem(
            run_key=self.run_key,
            run_values=self.run_values,
            keep_runs=self.keep_runs,
            args_templated=templated,
        )
        if problem:
            raise ValueError(problem)
        return self

    @property
    def resolved(self) -> bool:
        """Whether the controller filled this spec's run-key templates (tasks/retraining/run_keys.py)."""
        return bool(self.run_values)

    @field_validator("storage")
    @classmethod
    def _storage_form(cls, v: str) -> str:
        from spotrun.trainer.storage.registry import check_uri  # the registry imports nothing of the spec

        return check_uri(v)

    @model_validator(mode="before")
    @classmethod
    def _storage_per_job(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("storage") and isinstance(data.get("name"), str):
            return {**data, "storage": f"checkpoints/{data['name']}"}
        return data

    @model_validator(mode="before")
    @classmethod
    def _no_world_size(cls, data: Any) -> Any:
        if isinstance(data, dict) and "world_size" in data:
            raise ValueError(
                "world_size is derived now: remove it and set distributed.nproc_per_node "
                "(and distributed.nnodes) instead"
            )
        return data

    @property
    def world_size(self) -> int:
        """Ranks in all, from `distributed` (an `auto` count as 1 here: the trainer resolves it)."""
        return self.distributed.world_size() if self.distributed is not None else 1

    def spec_hash(self) -> str:
        """SHA-256 over the whole spec (canonical JSON)."""
        return _hash(self.model_dump(mode="json"))

    def open_storage(self, uri: str | None = None, *, create: bool = True) -> Storage:
        """The job's store, or another store of this job (`uri`: a run key's, a warm start's parent), opened
        with the options this job file gives the URI's scheme (`s3:` for s3://; the backend's
        `Backend.options` names the section). `create=False` (readers): a missing directory is an error."""
        uri = self.storage if uri is None else uri
        return open_storage(uri, self.storage_options(uri), create=create)

    def storage_options(self, uri: str | None = None) -> object:
        """The options this job file gives the scheme of `uri` (default: the job's store): `s3:` for
        s3://, None for a scheme without options."""
        backend = backend_for(self.storage if uri is None else uri)
        return getattr(self, backend.options) if backend is not None and backend.options else None

    def public_dump(self) -> dict[str, Any]:
        """The spec as JSON for anywhere but the client calls (the bucket, MLflow, logs): every URL's
        credentials redacted (`trainer.redact`)."""
        return dict(redact_tree(self.model_dump(mode="json")))

    def shape_hash(self, world_size: int | None = None) -> str:
        """SHA-256 over SHAPE_FIELDS: equal hashes can resume each other's checkpoints; unequal ones
        are told apart by `spec_changes`. `world_size`: the ranks actually running (default: the spec's)."""
        return _hash(self.shape_fields(world_size))

    def shape_fields(self, world_size: int | None = None) -> dict[str, Any]:
        """What `shape_hash` covers: SHAPE_FIELDS (a recipe job's exactly as in format 1), and an entry
        point job's `entrypoint` or a command job's `command`."""
        fields = {k: getattr(self, k) for k in SHAPE_FIELDS}
        if self.entrypoint is not None:
            fields["entrypoint"] = self.entrypoint
        if self.command is not None:
            fields["command"] = self.command
        return fields | ({"world_size": world_size} if world_size is not None else {})


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


UNSET = "(unset)"  # an arg one of the two specs does not give: the recipe's default applies


@dataclass(frozen=True)
class Change:
    """One setting that differs between a checkpoint's job (`old`) and this one (`new`); values as
    JSON text, so they compare and store the same everywhere."""

    field: str  # "seed", "args.lr"
    old: str
    new: str
    kind: Literal["shape", "trajectory"]

    def __str__(self) -> str:
        return f"{self.field} {self.old} -> {self.new}"

    def as_dict(self) -> dict[str, str]:
        return {"field": self.field, "old": self.old, "new": self.new}


def spec_changes(
    old: Mapping[str, Any], new: Mapping[str, Any], shape_args: Collection[str] | None = None
) -> list[Change]:
    """How job spec `new` differs from `old` (both in JSON form, as checkpoints store them), shape
    changes first. `shape_args`: the args that shape the state (None: all of them; `spec_shape_args`).
    A code field (recipe, entrypoint) that differs is a shape change; one an older spec does not have is
    absent both times. Any other field an older spec does not have is not compared."""
    out = [
        Change(k, _text(old.get(k)), _text(new.get(k)), "shape")
        for k in CODE_FIELDS
        if old.get(k) != new.get(k)
    ]
    old_args, new_args = old.get("args") or {}, new.get("args") or {}
    for k in sorted(set(old_args) | set(new_args)):
        a, b = old_args.get(k, UNSET), new_args.get(k, UNSET)
        if a != b:
            kind: Literal["shape", "trajectory"] = (
                "shape" if shape_args is None or k in shape_args else "trajectory"
            )
            out.append(Change(f"args.{k}", _text(a), _text(b), kind))
    for k in TRAJECTORY_FIELDS:
        if k in old and k in new and old[k] != new[k]:
            out.append(Change(k, _text(old[k]), _text(new[k]), "trajectory"))
    return sorted(out, key=lambda c: c.kind != "shape")


def describe_changes(changes: Collection[Change]) -> str:
    """`a 1 -> 2, b x -> y`: the changes as one message names them."""
    return ", ".join(str(c) for c in changes)


def _text(v: Any) -> str:
    return v if v == UNSET else json.dumps(v, sort_keys=True, separators=(",", ":"))


def parse_spec(data: Any, source: str = "job spec") -> JobSpec:
    """Validate a mapping into a JobSpec, turning pydantic's report into one actionable line."""
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: expected a mapping of fields (name, recipe or entrypoint, total_steps, ...)"
        )
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{source}: {explain_errors(e.errors(), JobSpec, data)}") from None


def load_spec(path: str | Path) -> JobSpec:
    """Load and validate a YAML job file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read job file {p}: {e.strerror}; check the path") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(
            f"{p}:{where} is not valid YAML ({getattr(e, 'problem', e)}); fix the syntax"
        ) from None
    return parse_spec(data, source=str(p))
