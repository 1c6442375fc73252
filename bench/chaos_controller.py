"""The chaos campaign's controller episodes: the controller itself is SIGKILLed, then started again.

One episode is one job run by a chain of controller processes, each this file run as a script:
`run_job` with a `PlainSink` over the local provider (the campaign's `chaos-python` as the worker's
python), the campaign's S3 storage behind the fault proxy, and SQLite history in its own SPOTRUN_HOME.
No Prefect server (the API address points at a closed port). 1-3 controllers are killed, each at one
of these instants (the kind `controller@WHERE`, counted when the controller died of SIGKILL):

  start    0.3-5 s after it was started: imports, adoption, stopping the leftover worker, provision
  train    0-1.5 s after its trainer's `started` record reached it
  save     from inside its trainer, 0-30 ms after the n-th entry into a checkpoint phase (the hook)
  between  0-0.5 s after it decided to retry an attempt its trainer ended by a self-SIGTERM (the hook)

Its trainer dies with it (PR_SET_PDEATHSIG). The next controller adopts the job run, if the killed one
had started or adopted it (its row in SQL names the killed controller's flow run) by then. Then one more
controller, never killed, runs the job to completion. Checked from outside afterwards (`finish`):
the SQL history (`bad_adoptions`, chaos_checks.py; attempt numbers 1..N once each, `lost_history_rows`),
every trainer's resume (`bad_resumes`, logged by the hook), writers (`duplicate_writers`), leftovers.

    python bench/chaos_controller.py --spec JOB.yaml --home DIR --workdir DIR --python EXE --flow-run-id ID
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import chaos_checks as checks  # noqa: E402
from bench.chaos_hook import PHASES, PLAN_ENV  # noqa: E402

if TYPE_CHECKING:
    import random

    from spotrun.tasks.history import HistoryStore
    from spotrun.trainer.spec.job import JobSpec


class Campaign(Protocol):
    """What an episode uses of the campaign (bench/chaos.py's `Campaign`, which imports this module)."""

    bucket: str
    moto: str
    python: Path
    rng: random.Random
    tally: checks.Tally

    def job(self, n: int) -> tuple[JobSpec, Path]: ...

    def s3_chaos(self) -> contextlib.AbstractContextManager[object]: ...

    def finish(
        self, n: int, ep: Path, history: HistoryStore | None, run_id: str, written: list[int]
    ) -> None: ...


WHERES = ("start", "train", "save", "between")
CONTROLLER_TIMEOUT_S = 240.0  # a job here trains in well under a minute; beyond this it hangs
MAX_CONTROLLERS = 8  # the kills plus the one that completes, plus restarts after its own errors
RETRY = re.compile(r"^attempt \d+: .* -> retry")


def main(argv: list[str] | None = None) -> int:
    """One controller: run the job to its end; exit 0 when it completed."""
    p = argparse.ArgumentParser(description="one chaos controller")
    for name in ("--spec", "--home", "--workdir", "--python", "--flow-run-id"):
        p.add_argument(name, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    from spotrun.tasks.control.loop import PlainSink, run_job
    from spotrun.tasks.decisions.policy import RetryPolicy
    from spotrun.tasks.providers.local import LocalProvider, LocalProviderConfig
    from spotrun.tasks.settings import Settings
    from spotrun.trainer.spec.job import load_spec

    home = Path(args.home)
    settings = Settings(home, f"sqlite:///{home / 'history.db'}")
    provider = LocalProvider(LocalProviderConfig(python=args.python, workdir=args.workdir), args.flow_run_id)
    # every kill leaves a lost attempt, an error to the policy: the budgets must outlast the campaign's
    policy = RetryPolicy(max_errors=100, same_error_limit=100, backoff_base_s=0.1, backoff_max_s=0.5)
    result = run_job(
        load_spec(Path(args.spec)),
        provider,
        policy,
        PlainSink(),
        settings=settings,
        flow_run_id=args.flow_run_id,
    )
    print(f"controller: {result.message}", file=sys.stderr, flush=True)
    return 0 if result.completed else 1


def episode(camp: Campaign, n: int) -> None:
    """Kill 1-3 controllers of one job, then let one complete it; check the history and the resumes."""
    from spotrun.tasks.ownership.adoption import read_worker
    from spotrun.tasks.settings import Settings

    job, spec_path = camp.job(n)
    ep = spec_path.parent
    home = ep / "home"
    settings = Settings(home, f"sqlite:///{home / 'history.db'}")
    kills = camp.rng.randint(1, 3)
    after_run: list[str] = []  # per kill once it held the job run: the worker it left ("" none)
    for k in range(1, MAX_CONTROLLERS + 1):
        where = camp.rng.choice(WHERES) if k <= kills else "none"
        t0, before = time.monotonic(), sum(camp.tally.faults.values())
        rc, tail = _controller(camp, n, k, where=where, spec_path=spec_path, ep=ep)
        killed = rc == -signal.SIGKILL
        note = ""
        if killed:
            camp.tally.faults[f"controller@{where}"] += 1
            if _took_over(settings, job.name, _flow_run_id(n, k)):
                worker = read_worker(settings.job_dir(job.name))
                after_run.append(worker.worker_id if worker is not None else "")
                note = f", left worker {after_run[-1] or '-'}"
            else:
                note = ", before it started or adopted the job run"
        say(
            f"  ep {n} controller {k}: {where:<8} -> {'SIGKILL' if killed else f'exit {rc}'}{note}, "
            f"{sum(camp.tally.faults.values()) - before} faults, {time.monotonic() - t0:.1f} s"
        )
        if rc == 0:
            break
        if not killed:  # restarted all the same, as the crashed-run automation would
            camp.tally.bad(f"episode {n} controller {k} ({where}) exited {rc} by itself: {' | '.join(tail)}")
    else:
        camp.tally.bad(f"episode {n}: no controller completed the job in {MAX_CONTROLLERS}")
    _check_history(camp, n, settings, job=job.name, kills=after_run)
    _check_resumes(camp, n, ep / "resumes.jsonl")
    camp.finish(n, ep, None, run_id="", written=[])


def _controller(
    camp: Campaign, n: int, k: int, *, where: str, spec_path: Path, ep: Path
) -> tuple[int, list[str]]:
    """Run one controller until it exits or is killed at `where`; its return code and last lines."""
    plan: dict[str, Any] = {
        "publog": str(ep / "writes.jsonl"),
        "resumes": {
            "log": str(ep / "resumes.jsonl"),
            "endpoint": camp.moto,
            "bucket": camp.bucket,
            "prefix": f"ep{n}",
            "cache": str(ep / "resume-cache"),
        },
    }
    if where in ("save", "between"):
        plan["kill"] = {
            "signal": "SIGKILL" if where == "save" else "SIGTERM",
            "phase": camp.rng.choice(PHASES),
            "nth": camp.rng.randint(1, 3),
            "delay_s": camp.rng.uniform(0, 0.03),
        }
        if where == "save":
            plan["kill"]["target"] = "parent"
    plan_path = ep / f"plan-{k}.json"
    plan_path.write_text(json.dumps(plan))
    env = {**os.environ, PLAN_ENV: str(plan_path), "PREFECT_API_URL": "http://127.0.0.1:9/api"}
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--spec",
        str(spec_path),
        "--home",
        str(ep / "home"),
        "--workdir",
        str(ep / "work"),
        "--python",
        str(camp.python),
        "--flow-run-id",
        _flow_run_id(n, k),
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    timers: list[threading.Timer] = []

    def kill_in(delay: float) -> None:
        t = threading.Timer(delay, _sigkill, (proc,))
        timers.append(t)
        t.start()

    if where == "start":
        kill_in(camp.rng.uniform(0.3, 5.0))
    tail: deque[str] = deque(maxlen=6)
    log = ep / f"controller-{k}.log"  # its whole log, the trainers' lines included (kept by --keep)
    reader = threading.Thread(target=_read, args=(proc, where, camp, kill_in, tail, log), daemon=True)
    with camp.s3_chaos():
        reader.start()
        try:
            rc = proc.wait(timeout=CONTROLLER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            camp.tally.bad(
                f"episode {n} controller {k} ({where}) still running after "
                f"{CONTROLLER_TIMEOUT_S:.0f} s: {' | '.join(tail)}"
            )
            proc.kill()
            rc = proc.wait()
            rc = 124  # not a fault of the campaign's making
        for t in timers:
            t.cancel()  # before the pid can be reused
        reader.join(timeout=5)
    return rc, list(tail)


def _read(
    proc: subprocess.Popen[str], where: str, camp: Campaign, kill_in: Any, tail: deque[str], log: Path
) -> None:
    """Follow the controller's log (copied to `log`); arm the kill once its line comes (one kill per
    controller)."""
    armed = False
    assert proc.stderr is not None
    with log.open("a") as out:
        for line in proc.stderr:
            out.write(line)
            line = line.rstrip()
            if not line.startswith("["):  # the trainer's own lines are echoed as `[worker] ...`
                tail.append(line[:300])
            if armed:
                continue
            if where == "train" and line.startswith("training from"):
                armed = True
                kill_in(camp.rng.uniform(0.0, 1.5))
            elif where == "between" and RETRY.match(line):
                armed = True
                kill_in(camp.rng.uniform(0.0, 0.5))


def _sigkill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)


def _flow_run_id(n: int, k: int) -> str:
    return f"chaos-{n}-controller-{k}"  # not a UUID: no controller asks Prefect about it


def _took_over(settings: Any, job: str, flow_run_id: str) -> bool:
    """Whether the killed controller had started or adopted the job run (its row names its flow run):
    only then must the next controller count a restart and record a lost attempt."""
    from spotrun.tasks.history import HistoryStore

    with HistoryStore.open(settings.database_url, journal_dir=settings.journal_dir) as store:
        return any(r.flow_run_id == flow_run_id for r in store.job_runs(job))


def _check_history(camp: Campaign, n: int, settings: Any, *, job: str, kills: list[str]) -> None:
    from spotrun.tasks.history import HistoryStore

    with HistoryStore.open(settings.database_url, journal_dir=settings.journal_dir) as store:
        runs = store.job_runs(job)
        rows = store.attempts(job=job, limit=10_000)
    camp.tally.attempts += len(rows)
    died = [r.worker_id for r in rows if "controller died" in r.cause]
    summary = [(r.status.value, r.controller_restarts) for r in runs]
    if (bad := checks.bad_adoptions(kills, summary, died)) > 0:
        camp.tally.bad_adoptions += bad
        camp.tally.bad(f"episode {n}: kills left {kills}, SQL has job runs {summary}, lost rows {died}")
    numbers = [r.attempt for r in rows]
    if (gaps := checks.history_gaps(range(1, max(numbers, default=0) + 1), numbers)) > 0:
        camp.tally.lost_history_rows += gaps
        camp.tally.bad(f"episode {n}: attempt numbers in SQL {numbers}")
    say(f"  ep {n}: job runs {summary}, attempts {[(r.attempt, r.outcome.value) for r in rows]}")


def _check_resumes(camp: Campaign, n: int, log: Path) -> None:
    lines = log.read_text().splitlines() if log.exists() else []
    if not lines:
        camp.tally.bad(f"episode {n}: no trainer's resume was logged")
    for entry in map(json.loads, lines):
        if entry["resumed_from"] != entry["expected"]:
            camp.tally.bad_resumes += 1
            camp.tally.bad(
                f"episode {n}: trainer {entry['pid']} resumed from {entry['resumed_from']}, "
                f"newest verified {entry['expected']}"
            )


def say(msg: str) -> None:
    print(msg, flush=True)


if __name__ == "__main__":
    sys.exit(main())
