"""Chaos campaign: >= 1,000 injected faults against real trainers on the local provider and moto S3.

Each episode is one job (a small digits model, a checkpoint every 3 steps, keep 2) in its own S3
prefix, run as a chain of attempts by the local provider, with `bench/chaos_hook.py` as the worker's
python. What is injected, and where (each fault counted once, by kind, only when it took effect):

  sigkill@PHASE / sigterm@PHASE  the signal lands inside a checkpoint phase (write, upload, verify,
                                 publish, retention) of the n-th save, from a timer in the trainer
  sigkill@random / sigterm@random  sent from outside at a random instant after training started
  disk-enospc / disk-eio         the local checkpoint write fails (full disk; EIO from fsync)
  duplicate                      a second trainer on the same storage, started with the first or once
                                 it trains
  s3-503 / s3-reset / s3-cut     the fault proxy in front of moto answers requests with 503 SlowDown,
                                 a connection reset, or half a body, several per attempt
  db-down                        the history database (PostgreSQL via a relay) goes away while
                                 attempts are recorded; the writes journal and replay on reopen
  controller@WHERE               every 4th episode: the controller (run_job in its own process) is
                                 SIGKILLed and started again, 1-3 times (bench/chaos_controller.py)

After every attempt, checked from outside: `latest` names a checkpoint that verifies; the trainer's
`started` record resumes from the newest checkpoint that verified just before it started (Catalog,
integrity only, through a client straight to moto); the two trainers of a duplicate never both train.
After every episode: the S3 write log shows no writer resuming after another (interleaving); every
attempt row written reaches SQL exactly once after replay; no process of the campaign is left. After a
controller episode: one job run, completed, controller_restarts and `lost (controller died)` rows
matching the kills (`bad_adoptions`).
Lost steps per preemption: the last step the killed attempt reported minus where the next resumed.

    .venv/bin/python bench/chaos.py [--faults 1000] [--seed 0] [--minutes 30] [--episode N ...]

Every episode draws from its own RNG, seeded by (seed, episode), and every attempt's S3 faults from
another (their thread draws while the attempt runs): `--seed S --episode N` replays episode N of seed
S alone, with the same choices (the timings of real processes still vary). Episodes 2, 6, 10, ... are
controller episodes. Prints progress and a per-kind table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import boto3  # noqa: E402
import yaml  # noqa: E402

from bench import chaos_checks as checks  # noqa: E402
from bench import chaos_controller  # noqa: E402
from bench.chaos_checks import Tally  # noqa: E402
from bench.chaos_hook import PHASES, PLAN_ENV, install  # noqa: E402
from spotrun.tasks.decisions.attempts import AttemptRecord, Outcome  # noqa: E402
from spotrun.tasks.history import HistoryStore  # noqa: E402
from spotrun.tasks.providers.base import WatchResult, Worker  # noqa: E402
from spotrun.tasks.providers.local import LocalProvider, LocalProviderConfig  # noqa: E402
from spotrun.trainer.checkpoint.format import COMPLETED  # noqa: E402
from spotrun.trainer.spec.job import JobSpec, parse_spec  # noqa: E402
from spotrun.trainer.storage.options import S3Options  # noqa: E402
from spotrun.trainer.storage.s3 import S3Storage, make_s3_client  # noqa: E402
from spotrun.trainer.telemetry.records import Record, Started  # noqa: E402
from tests.conftest import FAKE_AWS_ENV, UNSET_AWS_ENV  # noqa: E402
from tests.servers import FaultProxy  # noqa: E402

PROCESS_FAULTS = [f"{s}@{p}" for s in ("sigkill", "sigterm") for p in PHASES]
PROCESS_FAULTS += ["sigkill@random", "sigterm@random", "disk-enospc", "disk-eio", "duplicate"]
S3_KINDS = {"503": 0.4, "reset": 0.3, "cut": 0.3}
S3_PER_ATTEMPT = 6  # each costs up to seconds of botocore backoff; process faults need the time more
PG = ("127.0.0.1", 5432)
CONTROLLER_EVERY = 4  # episodes; a controller kill costs seconds (3.4 s of imports per start)


def say(msg: str) -> None:
    print(msg, flush=True)


class S3Chaos:
    """Keeps a few proxy faults pending while an attempt runs; counts the ones requests consumed."""

    def __init__(self, proxy: FaultProxy, rng: random.Random, tally: Tally) -> None:
        self.proxy, self.rng, self.tally = proxy, rng, tally
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._kind, self._seen = "503", proxy.injected
        self._start = proxy.injected

    def __enter__(self) -> S3Chaos:
        self._stop.clear()
        self._start = self.proxy.injected
        self._thread = threading.Thread(target=self._run, name="s3-chaos", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.proxy.fail_next(0)
        self._count()

    def _count(self) -> None:
        now = self.proxy.injected
        self.tally.faults[f"s3-{self._kind}"] += now - self._seen
        self._seen = now

    def _run(self) -> None:
        while not self._stop.wait(self.rng.uniform(0.2, 0.8)):
            self._count()
            if self.proxy.injected - self._start >= S3_PER_ATTEMPT:
                continue
            self._kind = self.rng.choices(list(S3_KINDS), list(S3_KINDS.values()))[0]
            # <= 2 in a row: botocore's standard retries (5 tries) ride them out; more is an outage
            self.proxy.fail_next(self.rng.randint(1, 2), self._kind)  # type: ignore[arg-type]


class Database:
    """PostgreSQL behind a relay the campaign stops and starts; None when no server answers."""

    def __init__(self, schema: str) -> None:
        from tests.integration.databases import Relay, free_port, pg_url

        self.relay = Relay(free_port()).start()
        self.url = pg_url("test", schema, self.relay.port)
        self.schema, self.up = schema, True

    @classmethod
    def try_open(cls) -> Database | None:
        from sqlalchemy import create_engine, text

        schema = f"chaos_{uuid.uuid4().hex[:10]}"
        try:
            engine = create_engine(f"postgresql+psycopg://postgres@{PG[0]}:{PG[1]}/test")
            with engine.begin() as conn:
                conn.execute(text(f'CREATE SCHEMA "{schema}"'))
            engine.dispose()
        except Exception as e:  # no server: the campaign runs without database faults and says so
            say(f"no PostgreSQL on {PG[0]}:{PG[1]} ({type(e).__name__}): no db-down faults")
            return None
        return cls(schema)

    def set_up(self, up: bool) -> bool:
        """Bring the database up or down; True when that changed its state."""
        if up == self.up:
            return False
        self.relay.start() if up else self.relay.stop()
        self.up = up
        return True

    def close(self) -> None:
        from sqlalchemy import create_engine, text

        self.relay.stop()
        engine = create_engine(f"postgresql+psycopg://postgres@{PG[0]}:{PG[1]}/test")
        with engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{self.schema}" CASCADE'))
        engine.dispose()


def episode_rng(seed: int, n: int, *tag: object) -> random.Random:
    """The RNG of episode `n` of campaign `seed` (or of one of its parts, `tag`): the same draws
    whichever episodes ran before it."""
    return random.Random("/".join(map(str, ("chaos", seed, n, *tag))))


@dataclass
class Campaign:
    root: Path
    seed: int
    proxy: FaultProxy
    moto: str
    bucket: str
    db: Database | None
    target: int  # faults: the episode in progress ends (with its checks) once they are reached
    keep: Path | None = None  # where the directory of an episode that broke an invariant is kept
    tally: Tally = field(default_factory=Tally)
    rng: random.Random = field(init=False)
    n: int = 0  # the episode in progress
    _parts: int = 0  # S3 fault threads the episode has started

    def __post_init__(self) -> None:
        self.begin(0)
        self.python = install(self.root)
        self.plan = self.root / "plan.json"
        os.environ[PLAN_ENV] = str(self.plan)
        self.direct = make_s3_client(S3Options(endpoint_url=self.moto))

    def begin(self, n: int) -> None:
        """Start episode `n`: its own RNG, so it can be replayed alone (`--episode`)."""
        self.n, self.rng = n, episode_rng(self.seed, n)
        self._parts = 0

    def s3_chaos(self) -> S3Chaos:
        """The S3 faults of one attempt (or controller), from their own RNG: their thread draws while
        the episode's own draws go on, in an order that timing decides."""
        self._parts += 1
        return S3Chaos(self.proxy, episode_rng(self.seed, self.n, "s3", self._parts), self.tally)

    def job(self, n: int) -> tuple[JobSpec, Path]:
        spec = {
            "name": f"chaos-{n}",
            "recipe": "digits",
            "args": {"hidden": 32, "dropout": 0.1},
            "total_steps": self.rng.choice([36, 48, 60]),
            "batch_size": 64,
            "seed": n,
            "threads": 1,
            "num_workers": self.rng.choice([0, 0, 1]),
            "log_every": 1,
            "checkpoint": {"every_steps": 3, "keep": 2},
            "storage": f"s3://{self.bucket}/ep{n}",
            "s3": {"endpoint_url": self.proxy.endpoint},
        }
        job = parse_spec(spec, f"chaos episode {n}")
        path = self.root / f"ep{n}" / "job.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False))
        return job, path

    def episode(self, n: int) -> None:
        job, spec_path = self.job(n)
        ep = spec_path.parent
        storage = S3Storage(self.direct, self.bucket, f"ep{n}", S3Options(endpoint_url=self.moto))
        provider = LocalProvider(LocalProviderConfig(python=str(self.python), workdir=str(ep / "work")))
        history = self._open_history()
        run_id = (
            history.start_job_run(job.name, job.spec_hash(), None, storage_uri=job.storage, provider="local")
            if history
            else ""
        )
        written: list[int] = []
        killed_at: int | None = None
        for attempt in range(1, self.rng.randint(3, 6) + 1):
            last = attempt > 1 and self.rng.random() < 0.15
            fault = "none" if last else self.rng.choice(PROCESS_FAULTS)
            expected = checks.newest_verified(storage, ep / "check-cache")
            if killed_at is not None:
                self.tally.lost_steps.append(killed_at - (expected or 0))
            t0, before = time.monotonic(), sum(self.tally.faults.values())
            results = self.attempt(job, spec_path, provider, attempt=attempt, fault=fault, ep=ep)
            self.tally.attempts += 1
            killed_at = self.judge(fault, results, expected, attempt=attempt, n=n)
            exits = ",".join(r.exit.name or "?" if r.exit else f"sig{r.signal}" for r in results)
            say(
                f"  ep {n} attempt {attempt}: {fault:<18} resumed {expected} -> {exits} at step "
                f"{results[0].last_step}, {sum(self.tally.faults.values()) - before} faults, "
                f"{time.monotonic() - t0:.1f} s"
            )
            for r in results:
                if r.exit is not None and r.exit.error:
                    say(f"    {r.exit.name}: {r.exit.error[:200]}")
            if (why := checks.latest_unreadable(storage, ep / "check-cache")) is not None:
                self.tally.unreadable_latest += 1
                self.tally.bad(f"episode {n} attempt {attempt} ({fault}): {why}")
            if history is not None:
                self._db_chaos()
                history.record_attempt(run_id, _record(attempt, results[0]))
                written.append(attempt)
            if last or _exists(storage, COMPLETED) or sum(self.tally.faults.values()) >= self.target:
                break
        self.finish(n, ep, history, run_id=run_id, written=written)

    def attempt(
        self, job: JobSpec, spec_path: Path, provider: LocalProvider, attempt: int, fault: str, ep: Path
    ) -> list[WatchResult]:
        plan: dict[str, Any] = {"publog": str(ep / "writes.jsonl")}
        sig, _, where = fault.partition("@")
        if where in PHASES:
            delay = self.rng.choice([0.0, self.rng.uniform(0, 0.03)])
            plan["kill"] = {
                "signal": sig.upper(),
                "phase": where,
                "nth": self.rng.randint(1, 4),
                "delay_s": delay,
            }
        elif fault.startswith("disk-"):
            plan["disk"] = {"errno": fault[5:].upper(), "nth": self.rng.randint(1, 4)}
        self.plan.write_text(json.dumps(plan))
        workers = [provider.provision(job, attempt, spec_path, [])]
        if fault == "duplicate" and self.rng.random() < 0.5:
            workers.append(provider.provision(job, attempt, spec_path, []))  # both at once
        results: list[WatchResult | None] = [None] * 2
        late: list[threading.Thread] = []  # a second trainer started once the first trains

        def watch(i: int, w: Worker) -> None:
            on_status = None
            if where == "random" and i == 0:
                on_status = self._killer(w, signal.SIGKILL if sig == "sigkill" else signal.SIGTERM)
            elif fault == "duplicate" and len(workers) == 1 and i == 0:
                on_status = self._second(
                    provider, job, attempt, spec_path=spec_path, workers=workers, watch=watch, late=late
                )
            results[i] = provider.watch(w, on_status)

        with self.s3_chaos():
            threads = [threading.Thread(target=watch, args=(i, w)) for i, w in enumerate(workers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for t in late:
                t.join()
        for w in workers:
            provider.release(w)
        return [r for r in results if r is not None]

    def _killer(self, w: Worker, sig: signal.Signals) -> Any:
        def on_status(rec: Record) -> None:
            if isinstance(rec, Started):
                delay = self.rng.uniform(0.0, 0.6)
                threading.Timer(delay, _signal, (w.handle.proc.pid, sig)).start()

        return on_status

    def _second(
        self,
        provider: LocalProvider,
        job: JobSpec,
        attempt: int,
        *,
        spec_path: Path,
        workers: list[Worker],
        watch: Any,
        late: list[threading.Thread],
    ) -> Any:
        def on_status(rec: Record) -> None:
            if isinstance(rec, Started) and len(workers) == 1:  # the first trains and holds the lease
                workers.append(provider.provision(job, attempt, spec_path, []))
                late.append(threading.Thread(target=watch, args=(1, workers[1])))
                late[0].start()

        return on_status

    def judge(
        self, fault: str, results: list[WatchResult], expected: int | None, *, attempt: int, n: int
    ) -> int | None:
        """Count the fault if it took effect and check the resumes; the last step, for a preemption."""
        first = results[0]
        if took_effect(fault, results):
            self.tally.faults[fault] += 1
        started = [r for r in results if r.started is not None]
        # of a duplicate that both trained, the later one began after the first let go: not comparable
        for r in started[:1]:
            got = r.resumed_from
            if got != expected:
                self.tally.bad_resumes += 1
                self.tally.bad(
                    f"episode {n} attempt {attempt} ({fault}): resumed from {got}, newest verified {expected}"
                )
        ends = [r.ended_at for r in started]
        begins = [r.started_training_at or 0.0 for r in started]
        if len(started) == 2 and min(ends) > max(begins):
            self.tally.duplicate_writers += 1
            self.tally.bad(f"episode {n} attempt {attempt}: two trainers trained at once")
        preempted = took_effect(fault, results) and fault.startswith(("sigkill", "sigterm"))
        return first.last_step if preempted else None

    def _open_history(self) -> HistoryStore | None:
        if self.db is None:
            return None
        return HistoryStore.open(self.db.url, journal_dir=self.root / "journal", connect_timeout_s=2)

    def _db_chaos(self) -> None:
        assert self.db is not None
        if self.rng.random() < 0.35 and self.db.set_up(not self.db.up) and not self.db.up:
            self.tally.faults["db-down"] += 1

    def finish(self, n: int, ep: Path, history: HistoryStore | None, run_id: str, written: list[int]) -> None:
        problems = len(self.tally.problems)
        writes = checks.publog(ep / "writes.jsonl")
        if (dup := checks.interleaved_writers(int(w["pid"]) for w in writes)) > 0:
            self.tally.duplicate_writers += dup
            self.tally.bad(f"episode {n}: {dup} writer(s) wrote to the storage after another one had")
            for line in checks.writer_runs(writes):
                say(f"    {line}")
        if history is not None and self.db is not None:
            if self.rng.random() < 0.5:
                self.db.set_up(True)
            history.close()  # down: what waits stays in the journal file for the next process to replay
            self.db.set_up(True)
            with self._open_history() as reopened:  # type: ignore[union-attr]
                rows = [r.attempt for r in reopened.attempts(job_run_id=run_id, limit=10_000)]
            if (gaps := checks.history_gaps(written, rows)) > 0:
                self.tally.lost_history_rows += gaps
                self.tally.bad(f"episode {n}: history wrote {written}, SQL has {rows}")
        deadline = time.monotonic() + 10
        while (left := checks.processes_with(str(self.root))) and time.monotonic() < deadline:
            time.sleep(0.1)
        if left:
            self.tally.leaked_processes += len(left)
            self.tally.bad(f"episode {n}: processes left: {left}")
            for pid in left:
                _signal(pid, signal.SIGKILL)
        self.tally.episodes += 1
        if self.keep is not None and len(self.tally.problems) > problems:
            shutil.copytree(ep, self.keep / ep.name, dirs_exist_ok=True)
        shutil.rmtree(ep, ignore_errors=True)


def took_effect(fault: str, results: list[WatchResult]) -> bool:
    """Whether the injected process fault happened (a trainer may finish before its n-th save)."""
    first = results[0]
    code = first.exit.name if first.exit is not None else None
    kind = fault.split("@")[0].split("-")[0]
    if kind == "sigkill":
        return first.signal == signal.SIGKILL
    if kind == "sigterm":
        return code == "PREEMPTED"
    if kind == "disk":
        return code == "CRASHED" and any(e in first.log_tail for e in ("No space left", "Input/output"))
    return kind == "duplicate" and len(results) == 2


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _exists(storage: S3Storage, key: str) -> bool:
    return any(o.key == key for o in storage.list(key))


def _record(attempt: int, r: WatchResult) -> AttemptRecord:
    return AttemptRecord(
        attempt=attempt,
        worker_id="chaos",
        provider="local",
        started_at=r.started_at,
        ended_at=r.ended_at,
        outcome=Outcome.CRASHED,
        cause="chaos",
        exit_code=r.exit_code,
        signal=r.signal,
        resumed_from=r.resumed_from,
        last_step=r.last_step,
        last_durable_step=r.last_durable_step,
    )


def table(tally: Tally) -> list[str]:
    lines = [f"{'fault':<22}{'count':>7}"]
    lines += [f"{k:<22}{v:>7}" for k, v in sorted(tally.faults.items())]
    lines.append(f"{'total':<22}{sum(tally.faults.values()):>7}")
    return lines


def run(
    faults: int,
    seed: int,
    minutes: float,
    *,
    root: Path,
    episodes: Sequence[int] | None = None,
    keep: Path | None = None,
) -> Tally:
    """A campaign until `faults` took effect (or `minutes` passed); or only the `episodes` named, each
    to its end. `keep`: where to copy the directory (logs, write log) of an episode with a violation."""
    saved = dict(os.environ)
    try:
        return _run(faults, seed, minutes, root=root, episodes=episodes, keep=keep)
    finally:  # the trainers inherit these; a caller's own (a test session's) come back afterwards
        os.environ.clear()
        os.environ.update(saved)


def _run(
    faults: int, seed: int, minutes: float, *, root: Path, episodes: Sequence[int] | None, keep: Path | None
) -> Tally:
    from moto.server import ThreadedMotoServer

    for k, v in FAKE_AWS_ENV.items():
        os.environ[k] = v
    for k in UNSET_AWS_ENV:
        os.environ.pop(k, None)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    proxy = FaultProxy(endpoint).start()
    db = Database.try_open()
    bucket = "spotrun-chaos"
    boto3.session.Session().client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    # named episodes run to their end; a campaign ends the episode that reaches its target early
    camp = Campaign(
        root,
        seed,
        proxy,
        moto=endpoint,
        bucket=bucket,
        db=db,
        target=sys.maxsize if episodes else faults,
        keep=keep,
    )
    t0 = time.monotonic()
    numbers = iter(episodes) if episodes else itertools.count(1)
    try:
        for n in numbers:
            if not episodes and (
                sum(camp.tally.faults.values()) >= faults or time.monotonic() - t0 >= minutes * 60
            ):
                break
            camp.begin(n)
            if n % CONTROLLER_EVERY == 2:
                chaos_controller.episode(camp, n)
            else:
                camp.episode(n)
            total = sum(camp.tally.faults.values())
            say(
                f"episode {n}: {total}/{faults} faults, {camp.tally.attempts} attempts, "
                f"{len(camp.tally.problems)} violations, {time.monotonic() - t0:.0f} s"
            )
    finally:
        proxy.stop()
        if db is not None:
            db.close()
        moto.stop()
    return camp.tally


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=1000, help="stop once this many faults took effect")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=30.0, help="stop after this long regardless")
    episode = "run only episode N of this seed, to its end (repeatable); --faults is ignored"
    p.add_argument("--episode", type=int, action="append", metavar="N", help=episode)
    keep = "copy the directory of every episode that broke an invariant here"
    p.add_argument("--keep", type=Path, metavar="DIR", help=keep)
    args = p.parse_args(argv)
    if args.episode and min(args.episode) < 1:
        p.error("--episode: episodes are numbered from 1")
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="spotrun-chaos-") as d:
        tally = run(args.faults, args.seed, args.minutes, root=Path(d), episodes=args.episode, keep=args.keep)
    for line in table(tally):
        say(line)
    say(f"{tally.episodes} episodes, {tally.attempts} attempts in {time.monotonic() - t0:.0f} s")
    say(json.dumps(tally.summary()))
    return 0 if not tally.problems else 1


if __name__ == "__main__":
    sys.exit(main())
