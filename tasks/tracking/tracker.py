"""The controller's side of experiment tracking: a thread that feeds one MLflow run per job run.

Nothing here is on the restart path. The thread imports MLflow (2-4 s) and opens the store while the
first trainer starts; the control loop only hands it attempt records and resume checks (a list append)
and waits for it at the end. Every POLL_S it sends what the trainers published to the job's storage
(`metrics/`, trainer/telemetry/metrics_log.py): steps covered by a durable checkpoint,
each once (mlflow_run.py); then deletes the objects MLflow holds that no resume check still reads
(collect.py), so the store and the listing of it every POLL_S stay the size of the job's recent past.

The run's id is created once and kept with the job: `tracking.json` in the job's storage (so whichever
controller, on whichever host, continues the job re-attaches) and `job_runs.mlflow_run_id` in SQL.

A tracking server that cannot be reached never stops training: one warning line per outage, the
metrics wait in storage (where the trainers wrote them anyway), and the thread retries every RETRY_S;
"back" is an INFO line with what was sent. At the end the run log waits for the last metrics, the model
and the run's status, up to FINISH_TIMEOUT_S (or OUTAGE_WAIT_S once the server is down); what is left
then is sent by the next run of the job, which re-attaches the same MLflow run.
"""

from __future__ import annotations

import json
import logging
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotrun.tasks.decisions.attempts import AttemptRecord, Outcome
from spotrun.tasks.providers.registry import capacity
from spotrun.tasks.tracking.collect import Hold, collect
from spotrun.tasks.tracking.fidelity import ResumeCheck, worst_verdict
from spotrun.tasks.tracking.mlflow_run import FIDELITY, RESUME_TAG, MlflowRun, embedded_store
from spotrun.tasks.tracking.steps import committed_step, metric_objects, read_steps
from spotrun.tasks.tracking.versions import finish_version, lineage_tags
from spotrun.trainer.checkpoint.catalog import Catalog
from spotrun.trainer.checkpoint.completion import completed_step
from spotrun.trainer.checkpoint.format import MANIFEST, MODEL_FILE, Manifest, checkpoint_uri
from spotrun.trainer.checkpoint.stateful import DCP_METADATA
from spotrun.trainer.errors import StorageError
from spotrun.trainer.redact import redact
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import Storage, get_bytes, put_bytes

log = logging.getLogger(__name__)

POLL_S = 5.0  # metrics reach MLflow this long after their checkpoint is durable, at most
RETRY_S = 5.0
FINISH_TIMEOUT_S = 600.0  # a large model's upload to a remote server
OUTAGE_WAIT_S = 10.0
TRACKING_FILE = "tracking.json"
STATUS = {"completed": "FINISHED", "failed": "FAILED", "cancelled": "KILLED", "crashed": "FAILED"}


@dataclass(frozen=True)
class Where:
    """Where a job's runs are tracked: resolved from the spec, the environment and SPOTRUN_HOME."""

    tracking_uri: str
    experiment: str
    artifact_root: str | None  # for the embedded store: $SPOTRUN_HOME/mlflow-artifacts
    embedded: Path | None  # the embedded store's file

    @property
    def shown(self) -> str:
        """The tracking URI for logs, summaries and the bucket: its credentials redacted."""
        return redact(self.tracking_uri)

    @classmethod
    def of(cls, job: JobSpec, home: Path, environ: dict[str, str]) -> Where:
        uri = job.tracking.uri or environ.get("MLFLOW_TRACKING_URI", "").strip()
        experiment = job.tracking.experiment or job.name
        if uri:
            return cls(uri, experiment, None, None)
        db = home / "mlflow.db"
        return cls(f"sqlite:///{db}", experiment, (home / "mlflow-artifacts").as_uri(), db)


@dataclass
class TrackingInfo:
    """What the flow's summary and `spotrun run` say about the MLflow run."""

    tracking_uri: str
    experiment: str
    experiment_id: str | None = None
    run_id: str | None = None
    url: str | None = None
    model: str | None = None  # "name/version" registered at completion
    sent_through: int = 0  # the last step whose metrics MLflow has
    pending: bool = False  # something is still to be sent (the server did not answer in time)
    # with `promote`: the gate's decision (tasks/decisions/promotion.py PromotionDecision.as_dict), with the
    # version and whether the alias moved; None: no gate, or the run did not complete in time to decide
    promotion: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class _Final:
    status: str  # a job-run status: completed, failed, cancelled, crashed


class Tracker:
    """One job run's MLflow run, fed by a background thread (see the module docstring)."""

    def __init__(
        self,
        job: JobSpec,
        where: Where,
        job_run_id: str,
        *,
        flow_run_id: str,
        provider: str,
        known_run_id: str | None = None,
        on_attached: Callable[[str], None] | None = None,
    ) -> None:
        self.job, self.where, self.job_run_id = job, where, job_run_id
        self.flow_run_id, self.provider, self.known_run_id = flow_run_id, provider, known_run_id
        self.on_attached = on_attached
        self.info = TrackingInfo(where.shown, where.experiment)
        self.run: MlflowRun | None = None
        self._pending: list[tuple[AttemptRecord | None, ResumeCheck | None]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._done = threading.Event()
        self._final: _Final | None = None
        self._stop = False
        self._down_since: float | None = None
        self._down_reason = ""
        self._sent = 0  # steps sent since the outage began (for the line that says it is back)
        self._gaps: set[tuple[int, int]] = set()  # reported already
        self._versioned = False  # the evaluation, lineage and promotion were sent (versions.py)
        self._resumes: dict[int, int] = {}  # attempt -> its resume step, until its record (and check) arrives
        self._last_steps: dict[int, int] = {}  # attempt -> its last step, from its record
        self._thread = threading.Thread(target=self._main, name="spotrun-tracking", daemon=True)

    def start(self) -> Tracker:
        self._thread.start()
        return self

    # -- the control loop's calls (never block) ---------------------------------------------------

    def attempt(self, record: AttemptRecord, check: ResumeCheck | None = None) -> None:
        """An attempt was recorded: its count and capacity as tags; a preemption event; its resume check."""
        with self._lock:
            self._pending.append((record, check))
        self._wake.set()

    def resumed(self, attempt: int, step: int | None) -> None:
        """Attempt `attempt` trains from checkpoint `step` (None: from scratch): the metrics its resume
        check reads, when it ends, stay in storage until then (collect.py)."""
        with self._lock:
            self._resumes[attempt] = step or 0

    def finish(self, status: str, timeout_s: float = FINISH_TIMEOUT_S) -> TrackingInfo:
        """Send the rest, register the model (completed), end the run; wait for it (bounded), then stop."""
        self._final = _Final(status)
        self._wake.set()
        t0 = time.monotonic()
        while not self._done.wait(0.2):
            now = time.monotonic()
            down = self._down_since
            if now - t0 > timeout_s or (down is not None and now - max(t0, down) > OUTAGE_WAIT_S):
                self.info.pending = True
                log.warning(
                    "MLflow at %s %s: metrics after step %d wait in %s/metrics/ and are sent when this job "
                    "runs again",
                    self.where.shown,
                    f"unreachable ({self._down_reason})" if down is not None else "too slow",
                    self.info.sent_through,
                    self.job.storage,
                )
                break
        self._stop = True
        self._wake.set()
        return self.info

    def close(self) -> None:
        """Stop without a final round: a flow run that found its run already completed sends nothing (a
        second registration or promotion decision could move the alias back to this older version)."""
        self._stop = True
        self._wake.set()

    # -- the thread ------------------------------------------------------------------------------

    def _main(self) -> None:
        storage: Storage | None = None
        while not self._stop:
            try:
                storage = storage or self.job.open_storage()
                finished = self._sync(storage)
                self._up()  # also when the round that got through after an outage was the last one
                if finished:
                    self._done.set()
                    return
            except Exception as e:  # the tracking server, storage or a bug: never the training's problem
                self._down(e)
            self._wake.wait(RETRY_S if self._down_since is not None else POLL_S)
            self._wake.clear()

    def _sync(self, storage: Storage) -> bool:
        """One round: attach, send new steps and events; at the end, the model and the status. True when
        the run is finished."""
        final = self._final  # read once: the last round sends everything published before it
        run = self.run or self._attach(storage)
        committed = committed_step(storage)
        objects = metric_objects(storage)
        steps = read_steps(storage, run.through, committed, objects=objects) if committed is not None else {}
        before = run.through
        for s in sorted(steps):  # objects are written in step order: a hole before a later step stays
            if s > before + 1:
                self._gap(before + 1, s - 1)
            before = s
        sent = run.log_steps(steps.values())
        self.info.sent_through = run.through
        self._sent += sent
        while self._pending:  # in order; only this thread takes from the front
            record, check = self._pending[0]
            self._send(run, record, check)
            with self._lock:
                self._pending.pop(0)
        if committed is not None:
            collect(storage, objects, sent_through=run.through, holds=self._holds(committed))
        if final is None:
            return False
        if final.status == "completed" and self.job.tracking.register_model and self.info.model is None:
            self.info.model = self._register(run, storage)
        if final.status == "completed" and not self._versioned:
            self._finish_version(run, storage)
        run.end(STATUS.get(final.status, "FAILED"))
        return True

    def _attach(self, storage: Storage) -> MlflowRun:
        if self.where.embedded is not None and self.where.artifact_root is not None:
            embedded_store(self.where.embedded, self.where.artifact_root)
        known = [k for k in (_stored_run(storage, self.where.tracking_uri), self.known_run_id) if k]
        job = self.job
        tags = {
            "mlflow.runName": f"{job.name}-{job.run_key if job.resolved else self.job_run_id[:8]}",
            "spotrun.job": job.name,
            "spotrun.job_run_id": self.job_run_id,
            "spotrun.flow_run_id": self.flow_run_id,
            "spotrun.provider": self.provider,
            "spotrun.storage": job.storage,
            "spotrun.spec_hash": job.spec_hash(),
            **lineage_tags(job),
        }
        run, created = MlflowRun.attach(
            self.where.tracking_uri,
            self.where.experiment,
            self.where.artifact_root,
            known=known,
            create_tags=tags,
            spec=job,
        )
        if not created:  # a new job run or controller continues it: who is feeding it now
            run.set_tags({k: v for k, v in tags.items() if k != "mlflow.runName"})
        ref = run.ref
        body = {"tracking_uri": self.where.shown, "experiment_id": ref.experiment_id, "run_id": ref.run_id}
        put_bytes(storage, TRACKING_FILE, json.dumps(body).encode())
        self.run = run
        self.info.experiment_id, self.info.run_id, self.info.url = ref.experiment_id, ref.run_id, ref.url()
        self.info.sent_through = run.through
        log.info("MLflow run %s (%s): %s", ref.run_id, "created" if created else "re-attached", ref.url())
        if self.on_attached is not None:
            self.on_attached(ref.run_id)
        return run

    def _holds(self, committed: int) -> list[Hold]:
        """What resume checks still read: the next attempt's at the newest checkpoint, and each running
        attempt's, through the step after the last of the attempt before it (everything after its start
        while that attempt's record has not arrived)."""
        with self._lock:
            resumes = dict(self._resumes)
            last = self._last_steps | {r.attempt: r.last_step for r, _ in self._pending if r is not None}
        holds = [Hold(committed, committed)]
        for attempt, start in resumes.items():
            if attempt - 1 in last:
                # through the step after the lost attempt's last: a continuity check reads start + 1
                holds.append(Hold(start, max([start, *(s for a, s in last.items() if a < attempt)]) + 1))
            elif attempt > 1:
                holds.append(Hold(start, None))
            # else the job run's first attempt: it has no check
        return holds

    def _send(self, run: MlflowRun, record: AttemptRecord | None, check: ResumeCheck | None) -> None:
        key = f"{self.job_run_id[:8]}.{record.attempt}" if record is not None else ""
        if record is not None:
            self._last_steps[record.attempt] = record.last_step
            with self._lock:  # its check is made (it is in the record): what it read may go
                self._resumes = {a: s for a, s in self._resumes.items() if a > record.attempt}
            run.set_tags(
                {
                    "spotrun.attempts": str(record.attempt),
                    "spotrun.capacity": _capacity(record, self.provider),
                }
            )
            if record.outcome is Outcome.PREEMPTED:
                text = f"attempt {record.attempt} at step {record.last_step}: {record.cause}"
                text += f"; lost {record.lost_steps} step(s)"
                run.log_preemption(key, record.last_step, text[:500])
        if check is not None:
            run.set_tags({RESUME_TAG + key: f"{check.verdict}: {check.detail}"[:500]})
            verdicts = [v.split(":", 1)[0] for k, v in run.tags.items() if k.startswith(RESUME_TAG)]
            worst = worst_verdict(verdicts)
            if worst is not None:
                run.set_tags({FIDELITY: worst})

    def _register(self, run: MlflowRun, storage: Storage) -> str | None:
        step = completed_step(storage)
        if step is None:
            log.warning("no COMPLETED.json in %s: no model registered", self.job.storage)
            return None
        tags = {
            "spotrun.flow_run_id": self.flow_run_id,
            "spotrun.job_run_id": self.job_run_id,
            "spotrun.checkpoint": checkpoint_uri(self.job.storage, step),
            "spotrun.step": str(step),
        }
        with _final_weights(storage, step) as weights:
            if weights is None:
                log.warning("checkpoint step %d has no %s: no model registered", step, MODEL_FILE)
                return None
            return run.register(self.job.name, weights, self.job, tags)

    def _finish_version(self, run: MlflowRun, storage: Storage) -> None:
        step = completed_step(storage)
        if step is None:
            return
        decision = finish_version(
            run, self.job, self.job_run_id, model=self.info.model, storage=storage, step=step
        )
        self.info.promotion = decision.as_dict() if decision is not None else None
        self._versioned = True

    def _gap(self, first: int, last: int) -> None:
        """Steps no metrics object holds, though later ones exist: the storage was trained on before
        tracking, or a trainer died after a checkpoint whose metrics write had failed. They stay missing
        in MLflow; say so once."""
        if (first, last) not in self._gaps:
            self._gaps.add((first, last))
            log.warning(
                "no per-step metrics for steps %d-%d in %s/metrics/: MLflow's history skips them",
                first,
                last,
                self.job.storage,
            )

    def _down(self, e: Exception) -> None:
        reason = " ".join(redact(f"{type(e).__name__}: {e}").split())[:300]
        if self._down_since is None:
            self._down_since, self._down_reason = time.monotonic(), reason
            log.warning(
                "MLflow at %s unavailable (%s): training continues; metrics wait in %s/metrics/ and are sent "
                "when it answers",
                self.where.shown,
                reason,
                self.job.storage,
            )
        else:
            log.debug("MLflow still unavailable: %s", reason)

    def _up(self) -> None:
        if self._down_since is not None:
            log.info("MLflow at %s is back: %d waiting step(s) sent", self.where.shown, self._sent)
        self._down_since, self._sent = None, 0


def _stored_run(storage: Storage, tracking_uri: str) -> str | None:
    """The MLflow run this storage's training goes to on this tracking server, if one was made."""
    try:
        body = json.loads(get_bytes(storage, TRACKING_FILE))
    except FileNotFoundError:
        return None
    except ValueError:
        log.warning("ignoring a malformed %s in %s", TRACKING_FILE, storage.uri)
        return None
    same = (
        body.get("tracking_uri") in (redact(tracking_uri), tracking_uri) if isinstance(body, dict) else False
    )
    if same and body.get("run_id"):  # written redacted; before that, as given
        return str(body["run_id"])
    return None


def _capacity(record: AttemptRecord, provider: str) -> str:
    market = (record.extra.get("cost") or {}).get("market")
    if market:
        return str(market)
    return capacity(provider)


@contextmanager
def _final_weights(storage: Storage, step: int) -> Iterator[Path | None]:
    """The final checkpoint's weights as one local safetensors file, removed on exit; None when the
    checkpoint has no model or fails its checks. The checkpoint is fetched and checked like any
    resume (safe names, digests, and with SPOTRUN_MANIFEST_KEY its signature) before a byte of it is
    loaded; a sharded one's model is merged from its DCP shards without unpickling
    (trainer/checkpoint/safe_load.py)."""
    with tempfile.TemporaryDirectory(prefix="spotrun-weights-") as d:
        out = Path(d)
        weights: Path | None = None
        try:
            path, problems = Catalog(storage, out / "cache").validate(step, None, integrity_only=True)
            if problems or path is None:
                why = "; ".join(str(p) for p in problems[:3])
                log.warning("final checkpoint step %d fails its checks, no model registered: %s", step, why)
            else:
                files = Manifest.from_json((path / MANIFEST).read_bytes(), step).files
                if MODEL_FILE in files:
                    weights = path / MODEL_FILE
                elif DCP_METADATA in files:
                    weights = _gather_dcp(path, files, out)
                else:  # a command's checkpoint (layout `directory`): HF's checkpoint-N/model.safetensors
                    nested = [f for f in files if f.rsplit("/", 1)[-1] == MODEL_FILE]
                    weights = path / nested[0] if len(nested) == 1 else None
        except (OSError, StorageError, ValueError) as e:
            log.warning("final weights of step %d not read: %s", step, e)
        yield weights


def _gather_dcp(checkpoint: Path, listed: Collection[str], out: Path) -> Path:
    """A sharded checkpoint's model as one safetensors file, merged from its DCP shards in this process."""
    import torch
    from safetensors.torch import save_file

    from spotrun.trainer.checkpoint.safe_load import load_full_state

    state = load_full_state(checkpoint, listed, keys=("model",))
    model = {k: v.contiguous() for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
    save_file(model, str(out / MODEL_FILE))
    return out / MODEL_FILE
