"""The local provider against real trainer subprocesses: a clean run, reclaims with and without notice,
a hung worker, release, and no trainer outliving the process (or thread) that started it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from spotrun.tasks.decisions.attempts import Outcome
from spotrun.tasks.decisions.outcome import add_facts, classify, to_record
from spotrun.tasks.providers.base import Provider, ProvisionError, WatchResult, Worker
from spotrun.tasks.providers.local import (
    LocalProvider,
    LocalProviderConfig,
    PlannedPreemption,
    SpotSimulatorConfig,
    worker_dir,
)
from spotrun.trainer.checkpoint.format import COMPLETED
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.preemption.lease import read_lease
from spotrun.trainer.spec.job import JobSpec, load_spec
from spotrun.trainer.storage import LocalStorage
from spotrun.trainer.telemetry.records import Record, Step
from tests.procs import gone, wait_gone
from tests.trainer_runs import REPO, write_spec

pytestmark = pytest.mark.timeout(120)


def _job(tmp_path: Path, **overrides: Any) -> tuple[JobSpec, Path]:
    spec = write_spec(tmp_path / "job.yaml", storage=str(tmp_path / "store"), **overrides)
    return load_spec(spec), spec


def _provider(tmp_path: Path, *plan: PlannedPreemption, **cfg: Any) -> LocalProvider:
    sim = SpotSimulatorConfig(schedule=list(plan))
    return LocalProvider(LocalProviderConfig(workdir=str(tmp_path / "work"), simulator=sim, **cfg))


def _watch(provider: LocalProvider, worker: Worker) -> tuple[WatchResult, list[dict[str, Any]], list[str]]:
    """Watch to the end, checking that callbacks run in this thread (where Prefect's run context is)."""
    statuses: list[Record] = []
    logs: list[str] = []
    me = threading.get_ident()

    def on_status(rec: Record) -> None:
        assert threading.get_ident() == me
        statuses.append(rec)

    def on_log(line: str) -> None:
        assert threading.get_ident() == me
        logs.append(line)

    try:
        result = provider.watch(worker, on_status, on_log)
    finally:
        provider.release(worker)
    return result, statuses, logs


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


LONG = {"total_steps": 5000, "checkpoint": {"every_steps": 50}}  # minutes: ends only when killed


def test_local_provider_satisfies_the_protocol() -> None:
    provider: Provider = LocalProvider()
    assert isinstance(provider, Provider) and provider.name == "local"


def test_run_without_preemption_completes(tmp_path: Path) -> None:
    job, spec = _job(tmp_path, total_steps=30)
    provider = _provider(tmp_path)
    provider.flow_run_id = "run-1234"
    worker = provider.provision(job, 1, spec, [])
    assert worker.id == f"local-{worker.handle.proc.pid}" and worker.provider == "local"
    result, statuses, logs = _watch(provider, worker)
    outcome, cause = classify(result, (tmp_path / "store" / COMPLETED).is_file())
    assert (outcome, cause) == (Outcome.COMPLETED, "completed at step 30")
    assert result.exit_code == 0 and result.trainer_code == "COMPLETED" and result.last_durable_step == 30
    kinds = [s.kind for s in statuses]
    assert kinds[0] == "started" and kinds[-1] == "exit" and "durable" in kinds
    assert any("completed at step 30" in line for line in logs) and "completed at step 30" in result.log_tail
    assert result.notice_at is None and not result.lost and result.started_training_at is not None
    assert result.started_at < result.started_training_at < result.ended_at
    record = to_record(worker, result, outcome, cause)
    assert record.lost_steps == 0 and 0 < record.productive_s < record.wall_s
    assert (worker_dir(tmp_path / "work", job) / "metrics.jsonl").is_file()  # --metrics under the workdir
    lease, _ = read_lease(LocalStorage(tmp_path / "store"))  # the lease names the worker as the flow does
    assert lease is not None and lease.released
    assert (lease.holder.worker_id, lease.holder.flow_run_id) == (worker.id, "run-1234")
    provider.release(worker)  # again, after watch: fine


SHADOW_LOOP = """\
import torch, spotrun, spotrun.trainer, trainer, beside_5e2

def main():
    open(beside_5e2.MARK, "w").write(trainer.__file__)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(16, 2), torch.randn(16, 1))
    with spotrun.session(model=model, optimizer=opt) as s:
        for x, y in s.batches(data):
            loss = torch.nn.functional.mse_loss(s.model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            s.step_done(loss)
"""


@pytest.mark.parametrize("forked", [True, False], ids=["forked", "fresh"])
def test_a_trainer_py_where_the_worker_starts_is_the_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forked: bool
) -> None:
    """A worker starts in the controller's directory, which holds a user's `trainer.py` and a module the
    loop imports; the entry point's module is elsewhere, on PYTHONPATH. The worker (`python -P -m
    spotrun.trainer`) runs spotrun's trainer, and the loop's `import trainer` gets the user's module."""
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    mark = tmp_path / "imported-trainer"
    (here / "trainer.py").write_text("OWNER = 'user'\n")
    (here / "beside_5e2.py").write_text(f"MARK = {str(mark)!r}\n")
    (elsewhere / "shadow_loop_5e2.py").write_text(SHADOW_LOOP)
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "name: shadow\nentrypoint: shadow_loop_5e2:main\ntotal_steps: 2\nbatch_size: 4\nthreads: 1\n"
        f"num_workers: 0\nstorage: {tmp_path / 'store'}\n"
    )
    monkeypatch.chdir(here)
    monkeypatch.setenv("PYTHONPATH", str(elsewhere))
    provider = _provider(tmp_path, fork_server=forked)
    worker = provider.provision(load_spec(spec), 1, spec, [])
    result, _, logs = _watch(provider, worker)
    assert result.exit_code == 0 and result.trainer_code == "COMPLETED", "\n".join(logs[-20:])
    assert mark.read_text() == str(here / "trainer.py")


def test_reclaim_with_notice_exits_preempted(tmp_path: Path) -> None:
    job, spec = _job(tmp_path, **LONG)
    provider = _provider(tmp_path, PlannedPreemption(after_s=0.5, notice=True), notice_s=30)
    worker = provider.provision(job, 1, spec, [])
    result, _, _ = _watch(provider, worker)
    outcome, cause = classify(result, False)
    assert outcome is Outcome.PREEMPTED and cause.startswith("spot notice, exited PREEMPTED after"), cause
    assert result.exit_code == ExitCode.PREEMPTED and result.notice_kind == "sim-notice"
    assert result.killed_at is None  # it left within the window
    assert result.stopping is not None and result.stopping.reason == "SIGTERM"
    assert result.last_durable_step == result.last_step > 0  # the emergency checkpoint
    assert result.notice_at is not None and result.started_training_at is not None
    assert result.notice_at - result.started_training_at >= 0.5


def test_a_trace_replay_reclaims_a_running_spot_worker_when_its_zone_empties(tmp_path: Path) -> None:
    """A one-zone trace of 1 s ticks replayed twice as fast (0.5 s a tick): capacity for 4 ticks, then
    none. The replay's clock is the test's: it moves to tick 4 once the trainer has taken steps, so the
    drop meets a running worker however slow the machine. The worker gets the notice, takes its
    emergency checkpoint and exits PREEMPTED, priced at the spot price; spot is then refused
    (retryable), on-demand still placed."""
    trace = tmp_path / "us-test-1a_v100_1.json"
    trace.write_text(json.dumps({"metadata": {"gap_seconds": 1}, "data": [1] * 4 + [0] * 60}))
    clock = [100.0]
    cfg = LocalProviderConfig(workdir=str(tmp_path / "work"), trace=str(trace), compress=2, notice_s=30)
    provider = LocalProvider(cfg, clock=lambda: clock[0])
    job, spec = _job(tmp_path, **LONG)
    worker = provider.provision(job, 1, spec, [])
    assert (worker.market, worker.zone) == ("spot", "us-test-1a")

    def on_status(rec: Record) -> None:
        if isinstance(rec, Step) and rec.step >= 3:
            clock[0] = 102.0  # 2 s in, at compress 2: tick 4, no capacity

    try:
        result = provider.watch(worker, on_status, None)
    finally:
        provider.release(worker)
    assert result.notice_kind == "sim-trace" and result.notice_at is not None
    assert result.facts["trace"] == {"zone": "us-test-1a", "reclaimed_at_tick": 4}
    outcome, cause = classify(result, False)
    assert outcome is Outcome.PREEMPTED and cause.startswith("spot notice, exited PREEMPTED after"), cause
    assert result.killed_at is None and result.last_durable_step == result.last_step >= 3
    record = to_record(worker, result, outcome, cause)
    add_facts(record, result, 1)
    cost = record.extra["cost"]
    assert (cost["market"], cost["zone"], cost["price_per_h"]) == ("spot", "us-test-1a", 0.918)
    assert cost["hours"] > 0 and cost["usd"] == pytest.approx(0.918 * cost["hours"])
    with pytest.raises(ProvisionError, match="no spot capacity in us-test-1a at trace tick 4") as e:
        provider.provision(job, 2, spec, [])
    assert e.value.retryable
    on_demand = provider.provision(job, 2, spec, [], market="on-demand")
    provider.release(on_demand)
    assert (on_demand.market, on_demand.zone) == ("on-demand", "")


def test_reclaim_without_notice_is_a_sigkill(tmp_path: Path) -> None:
    job, spec = _job(tmp_path, **LONG)
    provider = _provider(tmp_path, PlannedPreemption(after_s=0.5, notice=False))
    worker = provider.provision(job, 1, spec, [])
    result, _, _ = _watch(provider, worker)
    assert classify(result, False) == (Outcome.PREEMPTED, "reclaimed without notice (SIGKILL)")
    assert result.signal == signal.SIGKILL and result.notice_at is None and result.trainer_code is None
    assert _group_gone(worker.handle.proc.pid)


def test_hung_worker_is_lost_and_killed(tmp_path: Path) -> None:
    job, spec = _job(tmp_path, **LONG)
    provider = _provider(tmp_path, heartbeat_timeout_s=3)
    worker = provider.provision(job, 1, spec, ["--inject-fault", "hang@20"])
    pid = worker.handle.proc.pid
    result, _, _ = _watch(provider, worker)
    outcome, cause = classify(result, False)
    assert outcome is Outcome.LOST and cause.startswith("no heartbeat for 3") and "worker killed" in cause
    assert result.lost and result.kill_reason == "lost" and result.signal == signal.SIGKILL
    assert result.silent_s is not None and result.silent_s >= 3
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert _group_gone(pid)


def test_release_twice_before_watch(tmp_path: Path) -> None:
    job, spec = _job(tmp_path, **LONG)
    provider = _provider(tmp_path)
    worker = provider.provision(job, 1, spec, [])
    provider.release(worker)
    provider.release(worker)
    assert gone(worker.handle.proc.pid)
    result = provider.watch(worker, None, None)  # returns at once: the worker is gone
    assert result.kill_reason == "release" and result.signal == signal.SIGKILL
    assert classify(result, False)[0] is Outcome.CRASHED


def _fake_python(tmp_path: Path) -> Path:
    """An 'interpreter' that ignores its arguments: it starts a grandchild in its own process group (as
    data-loader workers do), records both pids and sleeps without ever writing to its pipes."""
    script = tmp_path / "fake-python"
    script.write_text(
        f"#!{sys.executable}\n"
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], process_group=0)\n"
        f"open({str(tmp_path / 'pids')!r} + '.tmp', 'w').write(f'{{child.pid}}')\n"
        f"__import__('os').replace({str(tmp_path / 'pids')!r} + '.tmp', {str(tmp_path / 'pids')!r})\n"
        "time.sleep(120)\n"
    )
    script.chmod(0o755)
    return script


def _read_pid(path: Path, timeout: float = 15) -> int:
    deadline = time.monotonic() + timeout
    while not path.is_file():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    return int(path.read_text())


def test_release_kills_the_whole_session_and_a_spawning_thread_may_end(tmp_path: Path) -> None:
    job, spec = _job(tmp_path)
    provider = _provider(tmp_path, python=str(_fake_python(tmp_path)), fork_server=False)
    box: list[Worker] = []
    t = threading.Thread(target=lambda: box.append(provider.provision(job, 1, spec, [])))
    t.start()
    t.join()  # PR_SET_PDEATHSIG follows the forking thread: this one is gone, the worker must not be
    worker = box[0]
    grandchild = _read_pid(tmp_path / "pids")
    time.sleep(0.3)
    assert not gone(worker.handle.proc.pid) and not gone(grandchild)
    provider.release(worker)
    assert gone(worker.handle.proc.pid) and wait_gone(grandchild, 5)


def test_release_from_another_thread_ends_a_watch(tmp_path: Path) -> None:
    job, spec = _job(tmp_path)
    provider = _provider(tmp_path, python=str(_fake_python(tmp_path)), fork_server=False)
    worker = provider.provision(job, 1, spec, [])
    _read_pid(tmp_path / "pids")
    timer = threading.Timer(0.3, provider.release, args=(worker,))
    timer.start()
    result = provider.watch(worker, None, None)  # a silent worker: only the release ends this
    timer.join()
    assert result.kill_reason == "release" and result.signal == signal.SIGKILL
    assert classify(result, False) == (
        Outcome.CRASHED,
        "killed by release() while running (flow cancelled or failed)",
    )


def test_provision_errors_are_not_retryable(tmp_path: Path) -> None:
    job, spec = _job(tmp_path)
    with pytest.raises(ProvisionError, match="does not exist") as e:
        _provider(tmp_path).provision(job, 1, tmp_path / "missing.yaml", [])
    assert not e.value.retryable
    with pytest.raises(ProvisionError, match="cannot start") as e:
        _provider(tmp_path, python=str(tmp_path / "no-python")).provision(job, 1, spec, [])
    assert not e.value.retryable


PARENT = """
import sys, time
from pathlib import Path
from spotrun.tasks.providers.local import LocalProvider, LocalProviderConfig
from spotrun.trainer.spec.job import load_spec
spec, workdir, python, forked = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "forked"
provider = LocalProvider(LocalProviderConfig(workdir=workdir, python=python, fork_server=forked))
worker = provider.provision(load_spec(spec), 1, spec, [])
print(worker.handle.proc.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("python", ["trainer", "silent"])
def test_worker_dies_with_the_process_that_started_it(tmp_path: Path, python: str) -> None:
    """`trainer`: the real trainer, a long job, forked from the fork server (which dies with the parent
    and takes the trainer along). `silent`: a fresh process that never writes, so only the parent-death
    signal can end it (a trainer would also die of a broken pipe at its next status line)."""
    _, spec = _job(tmp_path, **LONG)
    exe = sys.executable if python == "trainer" else str(_fake_python(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    how = "forked" if python == "trainer" else "fresh"
    cmd = [sys.executable, "-c", PARENT, str(spec), str(tmp_path / "work"), exe, how]
    parent = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        if python == "silent":
            grandchild = _read_pid(tmp_path / "pids")
        time.sleep(1.0)
        assert not gone(pid)
    finally:
        parent.kill()
        parent.wait()
    assert wait_gone(pid), f"worker {pid} outlived its parent"
    if python == "silent":  # the data-loader-like grandchild is only reached by the session kill...
        os.kill(grandchild, signal.SIGKILL)  # ...which a SIGKILLed parent cannot run: clean up after it


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_watch_stops_the_trainer_gracefully(
    tmp_path: Path, interruption: type[BaseException]
) -> None:
    """Ctrl-C (or a cancel, or a bug in a callback) in the controller while it watches: the trainer gets
    SIGTERM, takes its emergency checkpoint at the step it stopped at, and the partial result stays on
    the worker for the flow to record: a cancelled attempt that lost nothing."""
    job, spec = _job(tmp_path, **LONG)
    provider = _provider(tmp_path, stop_grace_s=60)
    worker = provider.provision(job, 1, spec, [])

    def on_status(rec: Record) -> None:
        if isinstance(rec, Step) and rec.step >= 20:
            raise interruption("stop")

    with pytest.raises(interruption):
        provider.watch(worker, on_status, None)
    provider.release(worker)  # as the flow's `finally` does: nothing left to do
    result = worker.result
    assert result is not None and result.ended_at > 0
    assert result.stopped_by == ("interrupt" if interruption is KeyboardInterrupt else "error")
    assert result.trainer_code == "PREEMPTED" and result.killed_at is None
    assert result.stopping is not None and result.stopping.reason == "SIGTERM"
    assert result.last_durable_step == result.last_step >= 20  # the emergency checkpoint: 0 lost steps
    outcome, cause = classify(result, False)
    assert outcome is Outcome.CANCELLED and f"emergency checkpoint at step {result.last_step}" in cause
    assert to_record(worker, result, outcome, cause).lost_steps == 0
    assert gone(worker.handle.proc.pid)


def test_a_trainer_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    job, spec = _job(tmp_path, **LONG)
    provider = _provider(tmp_path, stop_grace_s=0.5)
    worker = provider.provision(job, 1, spec, ["--inject-fault", "hang@1"])

    def on_status(rec: Record) -> None:
        if isinstance(rec, Step):  # step 1's record comes just before the hang (a SIGTERM sent before
            raise KeyboardInterrupt  # the first step would stop it before it could hang)

    with pytest.raises(KeyboardInterrupt):
        provider.watch(worker, on_status, None)
    result = worker.result
    assert result is not None and result.kill_reason == "stop-grace" and result.signal == signal.SIGKILL
    assert classify(result, False)[0] is Outcome.CANCELLED


@pytest.mark.parametrize("forked", [True, False], ids=["fork-server", "fresh-process"])
def test_the_controllers_secrets_never_reach_a_trainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forked: bool
) -> None:
    secrets = {
        "PREFECT_API_AUTH_STRING": "admin:hunter2",
        "SPOTRUN_SLACK_TOKEN": "xoxb-fake",
        "SPOTRUN_DATABASE_URL": "postgresql://u:pw@db/spotrun",
        "AWS_SECRET_ACCESS_KEY": "controller-secret",
    }
    for k, v in {**secrets, "PROBE_NAMED": "named", "PROBE_UNNAMED": "unnamed"}.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "env.json"
    job, spec = _job(
        tmp_path,
        recipe="tests.fakes.env_probe_recipe:build",
        args={"out": str(out)},
        env={"pass": ["PROBE_NAMED"], "set": {"PROBE_SET": "by the job"}},
    )
    provider = _provider(tmp_path, fork_server=forked)
    result, _, _ = _watch(provider, provider.provision(job, 1, spec, []))
    assert result.trainer_code == "CONFIG_ERROR", result.log_tail
    seen = json.loads(out.read_text())
    assert not set(secrets) & set(seen) and "PROBE_UNNAMED" not in seen
    assert (seen["PROBE_NAMED"], seen["PROBE_SET"]) == ("named", "by the job")
    assert seen["PATH"] == os.environ["PATH"] and seen["PYTHONUNBUFFERED"] == "1"
