"""The MLflow side of tracking: one run per job run, written so that a repeat never doubles anything.

Imported by the controller only, and only from the tracker's thread (`import mlflow` takes 2-4 s). Every
write is idempotent across controller restarts because what was sent is recorded in the run itself, in
the same `log_batch` call (one transaction on a SQL store, one request to a server):
  - metrics: the tag `spotrun.metrics_through` is the last step sent; steps at or before it are skipped;
  - preemptions: the tag `spotrun.preemption.<job run>.<attempt>` marks one as logged;
  - resume checks: a tag per attempt, set to the same value again on a repeat;
  - the model: a version whose `spotrun.checkpoint` tag names the final checkpoint is not registered again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from spotrun.tasks.tracking.steps import StepMetrics
from spotrun.trainer.redact import redact
from spotrun.trainer.spec.job import JobSpec

log = logging.getLogger(__name__)

# Defaults for this process only (a user's own settings win): no usage reports from a training
# controller; MLflow's INFO lines and its "View run" print off the terminal (spotrun says where the run
# is); a server that is down fails a call at once instead of after 7 retries with exponential backoff
# (~4 minutes, each retry a urllib3 warning line): the tracker retries every few seconds itself.
ENV_DEFAULTS = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_LOGGING_LEVEL": "WARNING",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}
STEPS_PER_BATCH = 300  # 3 metrics a step + the mark tag: within log_batch's 1,000 entities
PARAMS_PER_BATCH = 100  # log_batch's limit
THROUGH = "spotrun.metrics_through"
PREEMPTION_TAG = "spotrun.preemption."
RESUME_TAG = "spotrun.resume_check."
FIDELITY = "spotrun.resume_fidelity"
MODEL_VERSION = "spotrun.model_version"
PREEMPTIONS_METRIC = "spotrun/preemptions"


def import_mlflow() -> Any:
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    import mlflow

    return mlflow


def embedded_store(path: Path, artifact_root: str) -> None:
    """Create the embedded SQLite store from a migrated empty copy kept per MLflow version in the user's
    cache: a new store migrates ~100 revisions (1-3 s measured); a copy opens in 0.05 s. Best effort:
    without a template MLflow creates the store itself. Either way its Default experiment keeps its
    artifacts under `artifact_root` ($SPOTRUN_HOME): MLflow puts them in `./mlruns` of whatever
    directory first opened the store (the template's is the one that made it)."""
    if not path.exists():
        _from_template(path)
    _pin_default_experiment(path, artifact_root)


def _pin_default_experiment(path: Path, artifact_root: str) -> None:
    if not path.is_file():
        return  # MLflow creates it on first use; the next attach pins it
    try:
        with contextlib.closing(sqlite3.connect(path, timeout=30)) as db, db:
            where = f"{artifact_root.rstrip('/')}/0"
            db.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0", (where,))
    except sqlite3.Error as e:  # another MLflow schema, a locked file: MLflow's default stays
        log.debug("Default experiment of %s not moved under %s: %s", path, artifact_root, e)


def _from_template(path: Path) -> None:
    mlflow = import_mlflow()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spotrun"
    template = cache / f"mlflow-{mlflow.__version__}-empty.db"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not template.is_file():
            cache.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cache, prefix=".tmp-mlflow-", suffix=".db")
            os.close(fd)
            os.unlink(tmp)
            mlflow.MlflowClient(f"sqlite:///{tmp}").search_experiments(max_results=1)  # creates, migrates
            _sqlite_copy(Path(tmp), template)
            Path(tmp).unlink(missing_ok=True)
        _sqlite_copy(template, path)
    except (OSError, sqlite3.Error) as e:
        log.debug("no MLflow store template (%s): MLflow creates %s itself", e, path)


def _sqlite_copy(src: Path, dst: Path) -> None:
    """A consistent copy of a SQLite file, put in place by one rename."""
    tmp = dst.with_name(f".tmp-{dst.name}-{os.getpid()}")
    with sqlite3.connect(src) as a, sqlite3.connect(tmp) as b:
        a.backup(b)
    a.close()
    b.close()
    os.replace(tmp, dst)


@dataclass(frozen=True)
class RunRef:
    tracking_uri: str
    experiment_id: str
    run_id: str

    def url(self) -> str:
        """Where people open the run: the server's page, or the page `mlflow ui` serves for a local store."""
        uri = redact(self.tracking_uri)
        base = uri.rstrip("/") if uri.startswith("http") else "http://127.0.0.1:5000"
        return f"{base}/#/experiments/{self.experiment_id}/runs/{self.run_id}"


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The job spec as MLflow params: nested keys joined with dots, values as text (lists as YAML flow)."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out |= flatten(v, key + ".")
        else:
            text = v if isinstance(v, str) else yaml.safe_dump(v, default_flow_style=True).strip()
            out[key] = text.removesuffix("\n...")[:6000]
    return out


class MlflowRun:
    """One MLflow run, through MlflowClient (no global state: `mlflow.start_run` is never used)."""

    def __init__(self, client: Any, ref: RunRef, tags: dict[str, str]) -> None:
        self.client, self.ref = client, ref
        self.tags = dict(tags)  # as the run has them, kept current by this object's writes
        self.through = int(self.tags.get(THROUGH) or 0)

    @classmethod
    def attach(
        cls,
        tracking_uri: str,
        experiment: str,
        artifact_root: str | None,
        *,
        known: Sequence[str],
        create_tags: dict[str, str],
        spec: JobSpec,
    ) -> tuple[MlflowRun, bool]:
        """Re-attach the first run of `known` that exists and is not deleted, else create one (params:
        the spec, flattened). Returns the run and whether it was created."""
        mlflow = import_mlflow()
        client = mlflow.MlflowClient(tracking_uri)
        for run_id in known:
            try:
                run = client.get_run(run_id)
            except mlflow.exceptions.MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                continue
            if run.info.lifecycle_stage == "deleted":
                continue
            if run.info.status != "RUNNING":
                client.update_run(run_id, status="RUNNING")  # a failed job run continued by a new one
            ref = RunRef(tracking_uri, run.info.experiment_id, run_id)
            return cls(client, ref, dict(run.data.tags)), False
        experiment_id = _experiment(client, mlflow, experiment, artifact_root)
        run = client.create_run(experiment_id, tags=create_tags, run_name=create_tags.get("mlflow.runName"))
        me = cls(client, RunRef(tracking_uri, experiment_id, run.info.run_id), dict(run.data.tags))
        params = [mlflow.entities.Param(k, v) for k, v in flatten(spec.public_dump()).items()]
        for i in range(0, len(params), PARAMS_PER_BATCH):
            client.log_batch(run.info.run_id, params=params[i : i + PARAMS_PER_BATCH])
        return me, True

    def set_tags(self, tags: dict[str, str]) -> None:
        changed = {k: v for k, v in tags.items() if self.tags.get(k) != v}
        if changed:
            mlflow = import_mlflow()
            self.client.log_batch(
                self.ref.run_id, tags=[mlflow.entities.RunTag(k, v) for k, v in changed.items()]
            )
            self.tags |= changed

    def log_steps(self, steps: Iterable[StepMetrics]) -> int:
        """Send the steps after the mark, in order, each batch with the mark moved in the same call."""
        mlflow = import_mlflow()
        Metric, RunTag = mlflow.entities.Metric, mlflow.entities.RunTag
        todo = sorted((s for s in steps if s.step > self.through), key=lambda s: s.step)
        for i in range(0, len(todo), STEPS_PER_BATCH):
            chunk = todo[i : i + STEPS_PER_BATCH]
            metrics = []
            for s in chunk:
                ms = int(s.t * 1000) if s.t else int(time.time() * 1000)
                metrics.append(Metric("loss", s.loss, ms, s.step))
                if s.lr is not None:
                    metrics.append(Metric("lr", s.lr, ms, s.step))
                if s.steps_per_s is not None:
                    metrics.append(Metric("steps_per_s", s.steps_per_s, ms, s.step))
                metrics += [Metric(name, value, ms, s.step) for name, value in s.metrics.items()]
            mark = str(chunk[-1].step)
            self.client.log_batch(self.ref.run_id, metrics=metrics, tags=[RunTag(THROUGH, mark)])
            self.through, self.tags[THROUGH] = chunk[-1].step, mark
        return len(todo)

    def log_preemption(self, key: str, step: int, text: str) -> None:
        """One preemption: the metric `spotrun/preemptions` (the count so far) at `step`, and its tag."""
        tag = PREEMPTION_TAG + key
        if tag in self.tags:
            return
        mlflow = import_mlflow()
        n = sum(1 for k in self.tags if k.startswith(PREEMPTION_TAG)) + 1
        metric = mlflow.entities.Metric(PREEMPTIONS_METRIC, float(n), int(time.time() * 1000), step)
        self.client.log_batch(self.ref.run_id, metrics=[metric], tags=[mlflow.entities.RunTag(tag, text)])
        self.tags[tag] = text

    def register(self, name: str, weights: Path, spec: JobSpec, tags: dict[str, str]) -> str:
        """Log the weights and the spec as an MLflow model and register it as a new version of `name`;
        returns "name/version". A version of this run for the same checkpoint is not registered twice."""
        mlflow = import_mlflow()
        client, run_id = self.client, self.ref.run_id
        checkpoint = tags["spotrun.checkpoint"]
        for v in client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'"):
            if (v.tags or {}).get("spotrun.checkpoint") == checkpoint:
                return f"{name}/{v.version}"
        with tempfile.TemporaryDirectory(prefix="spotrun-model-") as d:
            out = Path(d)
            shutil.copyfile(weights, out / "model.safetensors")
            (out / "job.yaml").write_text(yaml.safe_dump(spec.public_dump(), sort_keys=False))
            model = client.create_logged_model(
                self.ref.experiment_id, name=name, source_run_id=run_id, tags=tags
            )
            meta = mlflow.models.Model(run_id=run_id, model_id=model.model_id)
            meta.add_flavor(
                "spotrun",
                weights="model.safetensors",
                spec="job.yaml",
                format="safetensors",
                step=tags.get("spotrun.step", ""),
            )
            meta.save(str(out / "MLmodel"))
            client.log_model_artifacts(model.model_id, str(out))
            client.finalize_logged_model(model.model_id, "READY")
        try:
            client.create_registered_model(name)
        except mlflow.exceptions.MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        version = client.create_model_version(
            name, source=model.artifact_location, run_id=run_id, tags=tags, model_id=model.model_id
        )
        return f"{name}/{version.version}"

    def end(self, status: str) -> None:
        self.client.set_terminated(self.ref.run_id, status=status)


def _experiment(client: Any, mlflow: Any, name: str, artifact_root: str | None) -> str:
    found = client.get_experiment_by_name(name)
    if found is not None:
        if found.lifecycle_stage == "deleted":
            client.restore_experiment(found.experiment_id)
        return str(found.experiment_id)
    try:
        location = f"{artifact_root.rstrip('/')}/{name}" if artifact_root else None
        return str(client.create_experiment(name, artifact_location=location))
    except mlflow.exceptions.MlflowException as e:  # another controller made it meanwhile
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return str(client.get_experiment_by_name(name).experiment_id)
