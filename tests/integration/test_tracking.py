"""Experiment tracking through real trainers and the plain-Python control loop (no Prefect server): one
MLflow run per job run with exactly one loss per step, equal bit for bit to an uninterrupted run's;
preemptions as MLflow events; the final weights as a registered model version; a tracking server that
goes away mid-run; and the resume-fidelity check on a recipe that breaks determinism on purpose."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from spotrun.tasks.control.loop import PlainSink, run_job
from spotrun.tasks.decisions.policy import RetryPolicy
from spotrun.tasks.history import HistoryStore
from spotrun.tasks.providers.local import (
    LocalProvider,
    LocalProviderConfig,
    PlannedPreemption,
    SpotSimulatorConfig,
)
from spotrun.tasks.settings import Settings
from spotrun.tasks.tracking import Tracker, Where
from spotrun.tasks.tracking import tracker as tracker_module
from spotrun.trainer.checkpoint.format import MANIFEST, MODEL_FILE, step_dir
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import LocalStorage, put_bytes
from spotrun.trainer.telemetry.metrics_log import MetricsLog
from tests.fakes.fault_python import install

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]


def _job(tmp_path: Path, **overrides: Any) -> JobSpec:
    spec: dict[str, Any] = {
        "name": "tracked",
        "recipe": "digits",
        "args": {"hidden": 32},
        "total_steps": 600,
        "threads": 1,
        "seed": 3,
        "checkpoint": {"every_steps": 25, "keep": 2},
        "storage": str(tmp_path / "store"),
        "log_every": 100,
    }
    return JobSpec.model_validate({**spec, **overrides})


def _provider(tmp_path: Path, *plan: tuple[float, bool]) -> LocalProvider:
    sim = SpotSimulatorConfig(schedule=[PlannedPreemption(after_s=s, notice=n) for s, n in plan])
    # a 2 s notice: at most 1 s of training through it (trainer/preemption/handover.py),
    # the attempts stay as planned
    return LocalProvider(LocalProviderConfig(workdir=str(tmp_path / "work"), simulator=sim, notice_s=2))


def _settings(tmp_path: Path) -> Settings:
    home = tmp_path / "home"
    return Settings(home, f"sqlite:///{home / 'history.db'}")


@pytest.fixture(autouse=True)
def env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # anything that calls Prefect fails
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _client(uri: str) -> Any:
    from spotrun.tasks.tracking.mlflow_run import import_mlflow

    return import_mlflow().MlflowClient(uri)


def _losses(metrics: Path) -> dict[int, set[str]]:
    """Every loss the trainers wrote per step (float.hex), over all attempts."""
    out: dict[int, set[str]] = {}
    for line in metrics.read_text().splitlines():
        d = json.loads(line)
        out.setdefault(int(d["step"]), set()).add(d["loss"])
    return out


def _reference(spec: JobSpec, tmp_path: Path) -> subprocess.Popen[str]:
    """The same job, uninterrupted, by the trainer alone (started beside the flow: threads are pinned)."""
    work = tmp_path / "reference"
    work.mkdir()
    cfg = work / "job.yaml"
    cfg.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    cmd = [sys.executable, "-m", "spotrun.trainer", "--config", str(cfg), "--storage", str(work / "store")]
    cmd += ["--metrics", str(work / "metrics.jsonl"), "--cache", str(work / "cache")]
    return subprocess.Popen(
        cmd,
        cwd=work,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_three_reclaims_make_one_run_with_the_uninterrupted_history_and_a_model(
    tmp_path: Path, mlflow_server: tuple[subprocess.Popen[bytes], int]
) -> None:
    """(`mlflow_server` only starts the next test's server now, so that its start overlaps this run.)"""
    # 1,200 steps: three reclaims at 0.3 s of training each, plus up to 1 s of training through each of
    # the two notices while the replacement starts (longer on a busy machine), all before the last step
    job = _job(tmp_path, total_steps=1200, s3={"endpoint_url": "https://spot:s3cret@127.0.0.1:9"})
    reference = _reference(job, tmp_path)
    settings = _settings(tmp_path)
    sink = PlainSink()
    provider = _provider(tmp_path, (0.3, True), (0.3, False), (0.3, True))
    result = run_job(job, provider, RetryPolicy(), sink, settings=settings, sleep=lambda s: None)
    assert result.completed, result.message
    _, err = reference.communicate(timeout=120)
    assert reference.returncode == 0, err[-2000:]

    m = result.summary.mlflow
    assert m is not None and m["model"] == "tracked/1" and not m["pending"]
    client = _client(f"sqlite:///{settings.home / 'mlflow.db'}")
    runs = client.search_runs([m["experiment_id"]])
    assert [r.info.run_id for r in runs] == [m["run_id"]] and runs[0].info.status == "FINISHED"
    history = client.get_metric_history(m["run_id"], "loss")
    assert sorted(h.step for h in history) == list(range(1, job.total_steps + 1))  # each step exactly once
    ref = {s: v.pop() for s, v in _losses(tmp_path / "reference" / "metrics.jsonl").items()}
    assert {h.step: h.value.hex() for h in history} == ref  # the uninterrupted run's, bit for bit
    assert len(client.get_metric_history(m["run_id"], "lr")) == job.total_steps

    preemptions = client.get_metric_history(m["run_id"], "spotrun/preemptions")
    assert sorted(p.value for p in preemptions) == [1.0, 2.0, 3.0]
    tags = runs[0].data.tags
    assert len([k for k in tags if k.startswith("spotrun.preemption.")]) == 3
    assert "without notice" in " ".join(v for k, v in tags.items() if k.startswith("spotrun.preemption."))
    assert tags["spotrun.resume_fidelity"] == "exact" and tags["spotrun.attempts"] == "4"

    # the replay after the reclaim without notice, and the notices' checks (attempt 2's only when it
    # reached a durable checkpoint before its reclaim: its first rate is known from storage then)
    checks = {c["attempt"]: c for c in result.summary.resume_checks}
    assert (checks[3]["method"], checks[3]["verdict"]) == ("replay", "exact") and checks[3]["steps"] > 0
    assert checks[4]["method"] == "continuity" and set(checks) <= {2, 3, 4}
    assert {c["verdict"] for c in checks.values()} == {"exact"} and result.summary.resume_fidelity == "exact"
    assert [e for e, _ in sink.events].count("spotrun.attempt.resume-checked") == len(checks)

    store = HistoryStore.open(settings.database_url)
    run_row, rows = store.job_runs("tracked")[-1], store.attempts(job="tracked")
    store.close()
    assert run_row.mlflow_run_id == m["run_id"]
    assert [r.extra.get("resume_check", {}).get("verdict") for r in rows][2:] == ["exact", "exact"]
    stored = json.loads((Path(job.storage) / "tracking.json").read_text())
    assert stored["run_id"] == m["run_id"]

    version = client.get_model_version("tracked", "1")
    final_dir = step_dir(job.total_steps)
    assert version.run_id == m["run_id"] and version.tags["spotrun.checkpoint"].endswith(final_dir)
    registered = load_file(str(Path(version.source.removeprefix("file://")) / "model.safetensors"))
    final = load_file(str(Path(job.storage) / step_dir(job.total_steps) / MODEL_FILE))
    assert registered.keys() == final.keys() and all(torch.equal(registered[k], final[k]) for k in final)

    # the endpoint's credentials reach none of: the bucket's markers and checkpoint specs, MLflow
    assert runs[0].data.params["s3.endpoint_url"] == "https://spot:***@127.0.0.1:9"
    model_yaml = Path(version.source.removeprefix("file://")) / "job.yaml"
    assert "spot:***@" in model_yaml.read_text()
    no_secret_in_store(Path(job.storage))


def no_secret_in_store(store: Path) -> None:
    """No file in the job's storage holds "s3cret": COMPLETED.json, tracking.json, the checkpoints'
    trainer.pt (its spec), manifests, metrics."""
    files = [f for f in store.rglob("*") if f.is_file()]
    assert any(f.name == "COMPLETED.json" for f in files) and any(f.name == "trainer.pt" for f in files)
    for f in files:
        data = f.read_bytes()
        if f.name == "trainer.pt":  # its spec, as loaded
            data = repr(torch.load(f, weights_only=True)).encode()
        assert b"s3cret" not in data, f


class Relay:
    """A TCP relay on 127.0.0.1 in front of a server: `down()` refuses connections (and cuts open ones)
    the way a server that is gone does; `up()` listens on the same port again."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def up(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(16)
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def down(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()  # the accept loop polls: a close alone would not wake a blocked accept()
        with self._lock:
            for c in self._conns:
                with contextlib.suppress(OSError):
                    c.close()
            self._conns.clear()

    def _accept(self, listener: socket.socket) -> None:
        while self._listener is listener:
            try:
                if not select.select([listener], [], [], 0.1)[0]:
                    continue
                client, _ = listener.accept()
            except (OSError, ValueError):
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, server]
            threading.Thread(target=self._pipe, args=(client, server), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while True:
                ready, _, _ = select.select([a, b], [], [], 1.0)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    (b if s is a else a).sendall(data)
        except (OSError, ValueError):
            return
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """`mlflow server` on a free 127.0.0.1 port; started early (module scope: its 10-20 s start overlaps
    the first test), waited for by whoever needs it (`_ready`)."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    cmd = [
        str(Path(sys.executable).with_name("mlflow")),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--backend-store-uri",
        f"sqlite:///{root / 'server.db'}",
        "--artifacts-destination",
        str(root / "artifacts"),
        "--workers",
        "1",
    ]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    with open(root / "server.log", "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield proc, port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)  # a test server: nothing of it to keep
        proc.wait(timeout=30)


def _ready(port: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"mlflow server on port {port} did not start in {timeout_s:.0f} s")


class OutageSink(PlainSink):
    """Takes the tracking server away when attempt 2 starts, and brings it back OUTAGE_S later: while
    attempt 2 trains (a fresh trainer takes ~3 s to start, and this job ~2 s more to finish), or once
    it has finished (a forked one starts in well under a second), when the final round is the first to
    get through."""

    OUTAGE_S = 3.0

    def __init__(self, relay: Relay) -> None:
        super().__init__()
        self.relay = relay

    def event(
        self, name: str, job: str, payload: dict[str, Any], labels: dict[str, str] | None = None
    ) -> None:
        super().event(name, job, payload, labels)
        if name == "spotrun.attempt.started" and payload["attempt"] == 2:
            self.relay.down()
            threading.Timer(self.OUTAGE_S, self.relay.up).start()


def test_a_tracking_server_down_mid_run_gets_the_same_history_once_it_returns(
    tmp_path: Path,
    mlflow_server: tuple[subprocess.Popen[bytes], int],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="spotrun.tasks.tracking.tracker")
    monkeypatch.setattr(tracker_module, "POLL_S", 0.5)  # notice the outage within an attempt
    monkeypatch.setattr(tracker_module, "RETRY_S", 0.5)
    _, port = mlflow_server
    _ready(port)
    relay = Relay(port)
    relay.up()
    uri = f"http://spot:s3cret@127.0.0.1:{relay.port}"  # credentials the server ignores, to be hidden
    job = _job(tmp_path, total_steps=400, tracking={"uri": uri, "register": False})
    provider = _provider(tmp_path, (0.3, True))
    try:
        result = run_job(
            job,
            provider,
            RetryPolicy(),
            OutageSink(relay),
            settings=_settings(tmp_path),
            sleep=lambda s: None,
        )
    finally:
        relay.down()
    assert result.completed, result.message
    m = result.summary.mlflow
    assert (
        m is not None and not m["pending"] and m["url"].startswith(f"http://spot:***@127.0.0.1:{relay.port}")
    )
    # every warning but the control loop's own "worker stopping" lines (urllib3's retries, MLflow's, ours)
    warnings = [
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name != "spotrun.control"
    ]
    assert len(warnings) == 1 and "unavailable" in warnings[0], warnings  # one line for the outage
    assert any("is back" in r.getMessage() for r in caplog.records)
    assert "s3cret" not in caplog.text and "s3cret" not in json.dumps(m)
    no_secret_in_store(Path(job.storage))

    client = _client(f"http://127.0.0.1:{port}")  # the server itself, past the relay
    history = client.get_metric_history(m["run_id"], "loss")
    assert sorted(h.step for h in history) == list(range(1, job.total_steps + 1))
    written = _losses(tmp_path / "work" / next((tmp_path / "work").iterdir()).name / "metrics.jsonl")
    assert all(len(v) == 1 for v in written.values())  # a deterministic job: one value per step
    assert {h.step: h.value.hex() for h in history} == {s: v.pop() for s, v in written.items()}
    assert len(client.get_metric_history(m["run_id"], "spotrun/preemptions")) == 1
    assert client.get_run(m["run_id"]).info.status == "FINISHED"
    assert (
        client.get_run(m["run_id"]).data.params["tracking.uri"] == f"http://spot:***@127.0.0.1:{relay.port}"
    )


def test_a_recipe_that_breaks_determinism_is_a_mismatch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _job(
        tmp_path,
        recipe="tests.fakes.nondeterministic_recipe:build",
        total_steps=300,
        tracking={"mlflow": False},
    )
    sink = PlainSink()
    # killed at a step, not after a time: steps past the newest checkpoint are lost, to be replayed
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"1": {"args": ["--inject-fault", "sigkill@37"]}}))
    monkeypatch.setenv("SPOTRUN_TEST_FAULT_PLAN", str(plan))
    provider = _provider(tmp_path)
    provider.cfg = provider.cfg.model_copy(update={"python": str(install(tmp_path))})
    result = run_job(job, provider, RetryPolicy(), sink, settings=_settings(tmp_path), sleep=lambda s: None)
    assert result.completed, result.message
    assert result.summary.mlflow is None and not (Path(job.storage) / "tracking.json").exists()
    (check,) = result.summary.resume_checks
    assert (check["attempt"], check["method"], check["verdict"]) == (2, "replay", "mismatch"), check
    assert result.summary.resume_fidelity == "mismatch"
    events = [p for name, p in sink.events if name == "spotrun.attempt.resume-checked"]
    assert [(e["verdict"], e["spotrun.resume.verdict"]) for e in events] == [("mismatch", "mismatch")]
    assert events[0]["first_diff"] == check["first_diff"] > check["resumed_from"]
    store = HistoryStore.open(_settings(tmp_path).database_url)
    rows = store.attempts(job="tracked")
    store.close()
    assert rows[1].extra["resume_check"]["verdict"] == "mismatch"


def _publish(storage: LocalStorage, steps: range, durable: int, loss: float = 1.0) -> None:
    """What a trainer writes with the checkpoint at `durable`: its metrics sidecar, then its manifest
    (trainer/telemetry/metrics_log.py)."""
    log = MetricsLog(storage)
    for s in steps:
        log.record(s, loss / s, 1e-3, 1e-3)
    for key, body in log.sidecars(durable).items():
        put_bytes(storage, key, body)
    put_bytes(storage, f"{step_dir(durable)}/{MANIFEST}", b"{}")


def test_the_next_controller_reattaches_and_sends_each_step_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two job runs of one job on one storage (the first failed): one MLflow run, re-attached through
    `tracking.json`; the steps the first sent are not sent again, a step published twice (recomputed
    after a quarantine) counts once, and steps no object holds are reported once."""
    job = _job(tmp_path, tracking={"uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "register": False})
    storage = LocalStorage(Path(job.storage))
    where = Where.of(job, tmp_path, {})
    _publish(storage, range(1, 11), 10)
    first = Tracker(job, where, "run-one", flow_run_id="flow-one", provider="local").start().finish("failed")
    assert first.run_id is not None and first.sent_through == 10
    _publish(storage, range(6, 16), 15, loss=2.0)  # 6-10 again: not sent twice, and not replaced
    _publish(storage, range(16, 21), 20)
    _publish(storage, range(31, 41), 40)  # 21-30 never written
    second = (
        Tracker(job, where, "run-two", flow_run_id="flow-two", provider="local").start().finish("completed")
    )
    assert second.run_id == first.run_id and second.sent_through == 40 and not second.pending
    client = _client(where.tracking_uri)
    history = {h.step: h.value for h in client.get_metric_history(first.run_id, "loss")}
    assert sorted(history) == [*range(1, 21), *range(31, 41)]  # each once
    assert history[8] == 1.0 / 8 and history[12] == 2.0 / 12
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["spotrun.flow_run_id"] == "flow-two"
    gaps = [r.getMessage() for r in caplog.records if "no per-step metrics" in r.getMessage()]
    assert len(gaps) == 1 and "steps 21-30" in gaps[0]


def test_the_embedded_store_writes_nothing_in_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registration from another directory: the model's files land under SPOTRUN_HOME, and no
    experiment of the store (MLflow's Default included) points at `./mlruns` of any directory."""
    import sqlite3

    from safetensors.torch import save_file

    from spotrun.tasks.tracking.mlflow_run import MlflowRun, embedded_store

    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    job = _job(tmp_path, name="cwdjob")
    where = Where.of(job, home, {})
    assert where.embedded is not None and where.artifact_root is not None
    embedded_store(where.embedded, where.artifact_root)
    run, _ = MlflowRun.attach(
        where.tracking_uri, where.experiment, where.artifact_root, known=[], create_tags={}, spec=job
    )
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    version = run.register("cwdjob", tmp_path / "model.safetensors", job, {"spotrun.checkpoint": "x"})
    assert version == "cwdjob/1"
    assert list(cwd.iterdir()) == []
    assert list((home / "mlflow-artifacts" / "cwdjob").rglob("model.safetensors"))
    with sqlite3.connect(where.embedded) as db:
        locations = [r[0] for r in db.execute("SELECT artifact_location FROM experiments")]
    assert len(locations) == 2 and all(loc.startswith(where.artifact_root) for loc in locations), locations
