"""One configuration of bench/scale.py: N jobs at once against one Prefect server and one history
database, each job's controller in a process of its own, plus one training run whose controller is
SIGKILLed for the zombie automation to find.

Each job is `python -m tests.fakes.fake_flow`: the controller (`run_job`, the Prefect sink, the job's
slot, SQL history) over the fake provider, its steps paced on the wall clock, its first attempts
reclaimed with a notice. It reports its own CPU seconds and peak RSS (getrusage) after its imports and
at its end; the attempts' times come from the shared history database; the zombie's from the server
(the killed run's last heartbeat event, and the time of its Crashed state). /proc/stat is sampled
meanwhile: on 2 shared cores, every latency is read beside how busy the CPUs were.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HEARTBEAT_S = 30  # Prefect's floor, what spotrun's deployments use (deployments/automations.py)
JOB_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Config:
    """What one configuration runs."""

    backend: str  # "sqlite" or "postgresql": the Prefect server's and the history's database
    jobs: int
    steps: int
    pace_s: float
    reclaims: int
    zombie_after_s: float
    out: Path


@dataclass
class CpuSampler:
    """The machine's CPU busy fraction (all cores), sampled from /proc/stat every `every_s`."""

    every_s: float = 1.0
    samples: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    @staticmethod
    def _read() -> tuple[int, int]:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = f[3] + f[4]
        return sum(f) - idle, sum(f)

    def run(self) -> None:
        busy0, total0 = self._read()
        while not self._stop.wait(self.every_s):
            busy, total = self._read()
            if total > total0:
                self.samples.append((busy - busy0) / (total - total0))
            busy0, total0 = busy, total

    @contextlib.contextmanager
    def running(self) -> Iterator[CpuSampler]:
        t = threading.Thread(target=self.run, daemon=True)
        t.start()
        try:
            yield self
        finally:
            self._stop.set()
            t.join()


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def p90(xs: list[float]) -> float | None:
    return sorted(xs)[min(len(xs) - 1, int(0.9 * len(xs)))] if xs else None


@contextlib.contextmanager
def databases(cfg: Config) -> Iterator[tuple[str | None, str]]:
    """(the Prefect server's database URL or None for SQLite in its home, the history's URL), fresh."""
    if cfg.backend == "sqlite":
        yield None, f"sqlite:///{cfg.out / 'history.db'}"
        return
    from tests.prefect_postgres import PG, connect, fresh_database

    history = f"spotrun_scale_history_{uuid.uuid4().hex[:8]}"
    with contextlib.closing(connect()) as conn, fresh_database("spotrun_scale_prefect") as prefect:
        conn.execute(f'CREATE DATABASE "{history}"')
        try:
            yield prefect, f"{PG}/{history}"
        finally:
            conn.execute(f'DROP DATABASE IF EXISTS "{history}" WITH (FORCE)')


def job_spec(cfg: Config, n: int) -> dict[str, Any]:
    return {
        "name": f"scale-{n:03d}",
        "recipe": "digits",  # never built: the fake provider runs no trainer
        "total_steps": cfg.steps,
        "checkpoint": {"every_steps": max(1, cfg.steps // 10), "keep": 3},
        "storage": str(cfg.out / "store" / f"{n:03d}"),
        "tracking": {"mlflow": False},
    }


def start_job(cfg: Config, n: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    d = cfg.out / "jobs" / f"{n:03d}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "job.json").write_text(json.dumps(job_spec(cfg, n)))
    cmd = [sys.executable, "-m", "tests.fakes.fake_flow", str(d / "job.json"), str(d / "report.json")]
    cmd += ["--reclaims", str(cfg.reclaims), "--pace", str(cfg.pace_s)]
    with open(d / "controller.log", "wb") as log:
        return subprocess.Popen(
            cmd, env={**env, "SPOTRUN_HOME": str(d / "home")}, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
        )


def start_victim(cfg: Config, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
    log = cfg.out / "victim.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fakes.silent_flow", "3600"],
            env=env,
            cwd=REPO,
            stdout=out,
            stderr=out,
        )
    return proc, log


def victim_id(proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 300) -> uuid.UUID:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("flow-run "):
                return uuid.UUID(line.split()[1])
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    raise RuntimeError(f"the silent training run did not start; see {log}")


def heartbeats(run_id: uuid.UUID) -> list[float]:
    """The times of the run's heartbeat events the server has stored."""
    from prefect import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    with get_client(sync_client=True) as client:
        beats = client.read_events(
            EventFilter(
                event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
                resource=EventResourceFilter(id=[f"prefect.flow-run.{run_id}"]),
            ),
            limit=50,
        ).events
    return [e.occurred.timestamp() for e in beats]


def wait_for_heartbeat(run_id: uuid.UUID, timeout_s: float = 180) -> float | None:
    """Seconds until the run's first heartbeat is stored (None: not within `timeout_s`). The trigger
    arms on it: a run killed before its first heartbeat reached the server is never marked (seen at 50
    jobs on SQLite, the heartbeat 2 s old and still in the dying process's event queue)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if heartbeats(run_id):
            return time.monotonic() - t0
        time.sleep(0.5)
    return None


def zombie_times(run_id: uuid.UUID, killed_at: float, timeout_s: float) -> dict[str, float | None]:
    """Wait for the killed run's Crashed state: seconds after the kill, and after its last heartbeat
    plus the window (how late the automation was)."""
    from prefect import get_client

    deadline = time.time() + timeout_s
    with get_client(sync_client=True) as client:
        while time.time() < deadline:
            state = client.read_flow_run(run_id).state
            if state is not None and state.is_crashed():
                break
            time.sleep(1)
        else:
            return {"crashed_after_kill_s": None, "late_s": None, "last_heartbeat_before_kill_s": None}
    crashed = state.timestamp.timestamp()
    last = max(heartbeats(run_id), default=killed_at)
    return {
        "crashed_after_kill_s": crashed - killed_at,
        "late_s": crashed - last - 0.0,  # the window is subtracted by the caller (it knows it)
        "last_heartbeat_before_kill_s": killed_at - last,
    }


def attempts_by_job(history_url: str, names: list[str]) -> dict[str, list[Any]]:
    """Each job's attempts from the shared history database, in order."""
    from spotrun.tasks.history import HistoryStore

    store = HistoryStore.open(history_url)
    try:
        return {name: sorted(store.attempts(job=name), key=lambda r: r.attempt) for name in names}
    finally:
        store.close()


def per_job(report: dict[str, Any], rows: list[Any]) -> dict[str, float]:
    """One controller's numbers: CPU and RSS from its report, times from its SQL attempts."""
    imported, ended = report["imported"], report["ended"]
    n = max(1, len(rows))
    flow_wall = ended["t"] - imported["t"]
    in_attempts = sum(r.ended_at - r.started_at for r in rows)
    gaps = [b.started_at - a.ended_at for a, b in itertools.pairwise(rows)]
    return {
        "attempts": float(len(rows)),
        "cpu_s": ended["cpu_s"],
        "import_cpu_s": imported["cpu_s"],
        "flow_cpu_s_per_attempt": (ended["cpu_s"] - imported["cpu_s"]) / n,
        "cpu_s_per_attempt": ended["cpu_s"] / n,
        "peak_rss_mb": ended["peak_rss_mb"],
        "overhead_s_per_attempt": max(0.0, flow_wall - in_attempts) / n,
        "reclaim_to_next_start_s": statistics.mean(gaps) if gaps else 0.0,
    }


def run_config(cfg: Config) -> dict[str, Any]:
    """Run one configuration; its summary (medians and p90 over the jobs, the zombie, the CPU)."""
    from spotrun.deployments.automations import ZOMBIE, RecoveryRules, build_recovery_automations
    from tests.prefect_postgres import seed_memo
    from tests.prefect_server import PrefectServer

    cfg.out.mkdir(parents=True, exist_ok=True)
    with databases(cfg) as (prefect_db, history_url):
        if prefect_db:
            seed_memo(cfg.out / "prefect")
        server = PrefectServer(cfg.out / "prefect", database=prefect_db).start(timeout_s=180)
        try:
            with server.clients():
                rules = RecoveryRules(zombie_after_s=cfg.zombie_after_s)
                (zombie,) = [a for a in build_recovery_automations(rules, uuid.uuid4()) if a.name == ZOMBIE]
                from prefect import get_client

                with get_client(sync_client=True) as client:
                    client.create_automation(zombie)
                env = {
                    **os.environ,
                    **server.client_env(),
                    "SPOTRUN_DATABASE_URL": history_url,
                    "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S),
                    "PYTHONPATH": str(REPO),
                }
                return _measure(cfg, env, history_url)
        finally:
            server.stop()


def _measure(cfg: Config, env: dict[str, str], history_url: str) -> dict[str, Any]:
    t0 = time.time()
    with CpuSampler().running() as cpu:
        victim, vlog = start_victim(cfg, env)
        procs = [start_job(cfg, n, env) for n in range(cfg.jobs)]
        vid = victim_id(victim, vlog)
        heartbeat_stored_s = wait_for_heartbeat(vid)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        killed_at = time.time()
        codes = [p.wait(timeout=JOB_TIMEOUT_S) for p in procs]
        jobs_done_at, busy = time.time(), list(cpu.samples)
        zombie = zombie_times(vid, killed_at, cfg.zombie_after_s + 150)
    zombie["first_heartbeat_stored_s"] = heartbeat_stored_s
    late = zombie["late_s"]
    zombie["late_s"] = late - cfg.zombie_after_s if late is not None else None
    names = [job_spec(cfg, n)["name"] for n in range(cfg.jobs)]
    rows = attempts_by_job(history_url, names)
    measured = []
    for n, name in enumerate(names):
        report_file = cfg.out / "jobs" / f"{n:03d}" / "report.json"
        if report_file.is_file():
            measured.append(per_job(json.loads(report_file.read_text()), rows[name]))
    keys = measured[0].keys() if measured else []
    return {
        "backend": cfg.backend,
        "jobs": cfg.jobs,
        "completed": sum(c == 0 for c in codes),
        "wall_s": jobs_done_at - t0,
        "cpu_busy": statistics.mean(busy) if busy else None,  # while the jobs ran
        "median": {k: median([m[k] for m in measured]) for k in keys},
        "p90": {k: p90([m[k] for m in measured]) for k in keys},
        "zombie": zombie,
    }
