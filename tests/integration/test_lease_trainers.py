"""One writer per job, with real trainers: a second trainer is refused, a dead one is taken over at once,
and a trainer whose lease is stolen stops publishing."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.chaos_checks import interleaved_writers, publog
from bench.chaos_hook import PLAN_ENV, install
from spotrun.trainer.checkpoint.catalog import list_checkpoints, read_latest
from spotrun.trainer.checkpoint.format import step_dir
from spotrun.trainer.errors import ConfigError, LeaseHeld
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.preemption.handover import read_standby
from spotrun.trainer.preemption.lease import LEASE_KEY, Holder, Lease, read_lease
from spotrun.trainer.storage import LocalStorage, Storage, open_storage
from spotrun.trainer.storage.options import S3Options
from tests.servers import FaultProxy
from tests.trainer_runs import REPO, assert_states_equal, trainer, write_spec

WAIT_S = 120  # generous: two cores shared with other test runs


def start(
    config: Path, storage: str, work: Path, *extra: str, python: Path | None = None, stdout: int | None = None
) -> subprocess.Popen[bytes]:
    """A trainer with its stderr in work/stderr; `python`: another interpreter (the chaos hook's)."""
    work.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(python or sys.executable),
        "-m",
        "spotrun.trainer",
        "--config",
        str(config),
        "--storage",
        storage,
    ]
    cmd += ["--metrics", str(work / "metrics.jsonl"), "--cache", str(work / "cache"), *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(work / "stderr", "wb") as err:  # the child keeps its own copy of the descriptor
        out = subprocess.DEVNULL if stdout is None else stdout
        return subprocess.Popen(cmd, cwd=work, env=env, stdout=out, stderr=err)


def wait_for_latest(store: Storage, proc: subprocess.Popen[bytes], at_least: int) -> int:
    deadline = time.monotonic() + WAIT_S
    while (step := read_latest(store) or 0) < at_least:
        assert proc.poll() is None, f"trainer exited early with {proc.returncode}"
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.02)
    return step


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if " ERROR " in line]


def test_second_trainer_refused_then_dead_holder_taken_over_at_once(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "job.yaml", total_steps=42)
    store_dir = tmp_path / "store"
    store = LocalStorage(store_dir)
    # holds the lease (60 s, so only a takeover, not an expiry, lets the next one in) and hangs at 15
    first = start(spec, str(store_dir), tmp_path / "a", "--inject-fault", "hang@15", "--lease-ttl", "60")
    try:
        wait_for_latest(store, first, 14)
        second = trainer(spec, str(store_dir), _mk(tmp_path / "b"))
        assert second.returncode == ExitCode.LEASE_HELD, second.stderr
        assert "Traceback" not in second.stderr
        (line,) = error_lines(second.stderr)
        assert f"is held by worker local-{first.pid} (flow run -, host " in line
        assert "stop that run or wait for the lease to expire" in line
        assert read_latest(store) == 14 and not (tmp_path / "b" / "cache").exists()  # touched nothing
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    third = trainer(spec, str(store_dir), _mk(tmp_path / "c"))
    assert third.returncode == ExitCode.COMPLETED, third.stderr
    assert f"(pid {first.pid}) is gone" in third.stderr  # taken at once, not after the 60 s expiry
    assert "resuming from step 14" in third.stderr
    reference = trainer(spec, str(tmp_path / "ref"), _mk(tmp_path / "r"))
    assert reference.returncode == 0, reference.stderr
    final = step_dir(42)
    assert_states_equal(store_dir / final, tmp_path / "ref" / final)
    lease, _ = read_lease(store)
    assert lease is not None and lease.released and lease.token == 2


def test_stolen_lease_stops_publishing(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "job.yaml", total_steps=5000)
    store_dir = tmp_path / "store"
    store = LocalStorage(store_dir)
    proc = start(spec, str(store_dir), tmp_path / "a")
    try:
        wait_for_latest(store, proc, 7)
        lease, version = read_lease(store)
        assert lease is not None and version is not None
        thief = Holder("thief", "run-x", "elsewhere", pid=1, pid_ns="other-boot:pid:[1]")
        stolen = dataclasses.replace(lease, holder=thief, token=lease.token + 1, expires_at=time.time() + 600)
        store.put_if(LEASE_KEY, stolen.to_json(), if_version=version)
        latest_at_theft = read_latest(store)
        rc = proc.wait(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = (tmp_path / "a" / "stderr").read_text()
    assert rc == ExitCode.LEASE_LOST, stderr
    assert "taken over by worker thief" in stderr and "Traceback" not in stderr
    assert read_latest(store) == latest_at_theft  # `latest` never moved again
    committed = [s for s, c in list_checkpoints(store).items() if c.committed]
    # at most the one checkpoint whose manifest check passed just before the theft; nothing after it
    assert max(committed) <= (latest_at_theft or 0) + 7
    assert read_lease(store)[0] == stolen  # the thief's lease is untouched: no release over it


def test_s3_live_holder_elsewhere_is_refused(tmp_path: Path, s3_bucket: tuple[str, str]) -> None:
    endpoint, bucket = s3_bucket
    uri = f"s3://{bucket}/job"
    spec = write_spec(tmp_path / "job.yaml", total_steps=14, s3={"endpoint_url": endpoint})
    store = open_storage(uri, S3Options(endpoint_url=endpoint))
    other = Holder("i-0abc", "run-7", "ip-10-0-0-7", pid=4242, pid_ns="other-boot:pid:[1]")
    Lease.acquire(store, other, ttl_s=600)  # a live trainer on another machine (never renewed: 600 s)
    result = trainer(spec, uri, _mk(tmp_path / "b"))
    assert result.returncode == ExitCode.LEASE_HELD, result.stderr
    (line,) = error_lines(result.stderr)
    assert f"storage {uri} is held by worker i-0abc (flow run run-7, host ip-10-0-0-7, pid 4242)" in line
    assert list_checkpoints(store) == {}
    # the controller released that instance: the next attempt takes over at once
    taken = trainer(spec, uri, _mk(tmp_path / "c"), "--lease-takeover", "i-0abc")
    assert taken.returncode == ExitCode.COMPLETED, taken.stderr
    assert "i-0abc was released by the controller" in taken.stderr


def _mk(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def test_prewarmed_trainer_waits_for_the_durable_emergency_checkpoint(
    tmp_path: Path, s3_bucket: tuple[str, str], fault_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replacement started at the notice builds its recipe, then waits on the lease; the old trainer's
    emergency checkpoint uploads slowly (every PUT delayed 1 s); the replacement resumes from exactly that
    checkpoint, and only after it was durable.

    Both run under the chaos campaign's hook, which logs every write only a lease holder may make: the
    log shows one writer after the other. This is the handover of `bench/chaos.py --seed 23`'s episode
    42 (a controller episode whose trainer was stopped by SIGTERM): the replacement wrote its standby
    while the old trainer still held the lease, and a log that counted that write found the old trainer
    and then the replacement each writing "after another writer had" (duplicate_writers: 2)."""
    _, bucket = s3_bucket
    spec = write_spec(tmp_path / "job.yaml", total_steps=100_000, s3={"endpoint_url": fault_proxy.endpoint})
    uri = f"s3://{bucket}/prewarm"
    store = open_storage(uri, S3Options(endpoint_url=fault_proxy.endpoint))
    hooked = install(tmp_path)
    (tmp_path / "plan.json").write_text(json.dumps({"publog": str(tmp_path / "writes.jsonl")}))
    monkeypatch.setenv(PLAN_ENV, str(tmp_path / "plan.json"))
    old = start(spec, uri, tmp_path / "old", python=hooked)
    new: subprocess.Popen[bytes] | None = None
    try:
        wait_for_latest(store, old, 7)
        new = start(
            spec,
            uri,
            tmp_path / "new",
            "--prewarm-wait",
            "120",
            "--max-steps",
            "5",
            python=hooked,
            stdout=subprocess.PIPE,
        )
        deadline = time.monotonic() + WAIT_S
        while "prewarmed: waiting" not in (tmp_path / "new" / "stderr").read_text():
            assert new.poll() is None and time.monotonic() < deadline, (
                tmp_path / "new" / "stderr"
            ).read_text()
            time.sleep(0.05)
        fault_proxy.put_delay_s = 1.0
        old.send_signal(signal.SIGTERM)  # the notice: finish the step, save, upload slowly, exit
        assert old.wait(timeout=WAIT_S) == ExitCode.PREEMPTED
        durable_at = time.time()
        fault_proxy.put_delay_s = 0.0
        out, _ = new.communicate(timeout=WAIT_S)
    finally:
        for p in (old, new):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    old_err = (tmp_path / "old" / "stderr").read_text()
    stopped = int(old_err.split("stopped on SIGTERM at step ")[1].split(";")[0])
    started = [
        json.loads(line[len("@spotrun ") :])
        for line in out.decode().splitlines()
        if line.startswith('@spotrun {"kind":"started"')
    ]
    assert new.returncode == ExitCode.STOPPED, (tmp_path / "new" / "stderr").read_text()[-3000:]
    assert started[0]["resumed_from"] == stopped  # the emergency checkpoint, not an older one
    assert started[0]["t"] >= durable_at - 1.0  # it waited for it (the old one exited once durable)
    standby = read_standby(store)  # the replacement stood by; the old trainer's last save came after
    assert standby is not None and (standby.replacing, standby.state) == (f"local-{old.pid}", "waiting")
    pids = [int(w["pid"]) for w in publog(tmp_path / "writes.jsonl")]
    assert pids[0] == old.pid and pids[-1] == new.pid and interleaved_writers(pids) == 0


def test_s3_lease_age_comes_from_the_stores_clock(s3_bucket: tuple[str, str]) -> None:
    endpoint, bucket = s3_bucket
    store = open_storage(f"s3://{bucket}/age", S3Options(endpoint_url=endpoint))
    holder = Lease.acquire(store, Holder("i-0abc", None, "ip-10-0-0-7", pid=1, pid_ns="b:pid:[1]"), ttl_s=30)
    stamped = store.read_stamped(LEASE_KEY)
    assert stamped.version == holder.version and 0.0 <= stamped.age_s <= 2.0  # Date - Last-Modified
    # the holder wrote a wall clock an hour ahead into the object: a taker does not read it
    skewed = dataclasses.replace(holder.doc, expires_at=holder.doc.expires_at - 3600)
    store.put_if(LEASE_KEY, skewed.to_json(), if_version=holder.version)
    with pytest.raises(LeaseHeld, match=r"held by worker i-0abc .* \(in 3[01] s\)"):
        Lease.acquire(store, Holder("i-0def", None, "ip-10-0-0-8", pid=1, pid_ns="c:pid:[1]"), ttl_s=30)


def test_a_store_that_ignores_conditional_puts_is_refused(
    tmp_path: Path, s3_bucket: tuple[str, str], fault_proxy: FaultProxy
) -> None:
    _, bucket = s3_bucket
    fault_proxy.drop_conditions = True  # as an S3-compatible store without conditional writes
    uri = f"s3://{bucket}/unconditional"
    store = open_storage(uri, S3Options(endpoint_url=fault_proxy.endpoint))
    with pytest.raises(ConfigError, match="ignored If-None-Match: \\* on PutObject"):
        Lease.acquire(store, Holder("w", None, "h", pid=1, pid_ns="b:pid:[1]"))
    assert store.list() == []  # the probe cleaned up after itself; no lease was written
    spec = write_spec(tmp_path / "job.yaml", total_steps=14, s3={"endpoint_url": fault_proxy.endpoint})
    result = trainer(spec, uri, _mk(tmp_path / "t"))
    assert result.returncode == ExitCode.CONFIG_ERROR, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = error_lines(result.stderr)
    assert "two trainers could both take the storage lease" in line, line
    assert list_checkpoints(store) == {}
