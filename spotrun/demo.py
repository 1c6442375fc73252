"""`python -m spotrun.demo` (`make demo`): train a job to completion through the resilient-training flow
while a simulated spot market takes its workers away three times, then show that it ends bit for bit
where an uninterrupted run ends. The three restarts raise one restart-storm alert through the real
path (deployments applied, automations, a worker running the alert flow): printed here, and sent to
Slack when SPOTRUN_SLACK_WEBHOOK_URL (or SPOTRUN_SLACK_TOKEN + SPOTRUN_SLACK_CHANNEL) is set. The job
is tracked in MLflow (the embedded store): one run whose per-step losses equal the uninterrupted run's,
with the three preemptions and the registered model; the demo says how to browse it with `mlflow ui`.

PREFECT_API_URL and SPOTRUN_DATABASE_URL are ignored: the demo records its run in the history database
of $SPOTRUN_HOME (default ~/.spotrun), so a plain `spotrun history` shows it afterwards. Under
$SPOTRUN_HOME:
  history.db the SQLite restart history, shared with every other spotrun command of this home
  demo/      this demo's data, cleared first: checkpoints/ (the object-storage directory), mlflow.db
             and mlflow-artifacts/ (the MLflow run and model), jobs/digits/ (workers, metrics,
             timeline), reference/ (an uninterrupted `python -m spotrun.trainer` run of the same job, made in
             the background) and worker.log (the Prefect worker that runs the alert flow)
  prefect/   the Prefect server (SQLite): the background one (`spotrun server start`) when it runs,
             else one started for the demo and stopped after it (--keep-server: left running as the
             background server, to browse the run in the UI). With --prefect-database URL a server
             started here keeps its runs on that PostgreSQL database instead (docs/operations.md).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from safetensors.torch import load_file

from spotrun import prefect_db, run_cmd
from spotrun.console import spotrun_command, wide_console
from spotrun.demo_alerts import alerting, show_alert, wait_for_alert
from spotrun.deployments.apply import SHIPPED
from spotrun.live import metrics_record
from spotrun.server import PrefectApi, prefect_api, running_server, server_home
from spotrun.tasks.decisions.attempts import Outcome
from spotrun.tasks.decisions.policy import RetryPolicy
from spotrun.tasks.history import default_url
from spotrun.tasks.providers.local import (
    OMP_WAIT,
    LocalProviderConfig,
    PlannedPreemption,
    SpotSimulatorConfig,
)
from spotrun.tasks.settings import Settings, spotrun_home
from spotrun.trainer.checkpoint.catalog import fetch
from spotrun.trainer.checkpoint.format import MODEL_FILE, load_part
from spotrun.trainer.checkpoint.state import iter_tensors
from spotrun.trainer.errors import SpotrunError
from spotrun.trainer.interpreter import python_m
from spotrun.trainer.spec.job import JobSpec, load_spec
from spotrun.trainer.storage import open_storage
from spotrun.trainer.storage.locks import private_home

DEMO_JOB = SHIPPED / "jobs" / "digits.yaml"  # in the installed package
REFERENCE_TIMEOUT_S = 300.0
# The demo trains digits.yaml for TOTAL_STEPS, reclaiming each of the first three attempts after
# SCHEDULE's seconds of training (counted from its first step). Seconds, not steps, because that is
# how a spot market behaves. A noticed worker trains on until its replacement stands by (at most half
# the NOTICE_S window: trainer/preemption/handover.py), so TOTAL_STEPS must outlast 1.6 s + 2 x 3 s of
# training on a fast machine (2 idle cores run 150-450 steps/s, depending on what else runs): at 500 steps/s
# the third reclaim still comes before step 3,800.
TOTAL_STEPS = 4000
SCHEDULE = [
    PlannedPreemption(after_s=0.5, notice=True),
    PlannedPreemption(after_s=0.5, notice=False),
    PlannedPreemption(after_s=0.6, notice=True),
]
NOTICE_S = 6.0
console = wide_console()


def prepare(home: Path) -> tuple[Path, JobSpec]:
    """Clear the demo directory and write the demo job into it, its storage under the directory."""
    shutil.rmtree(home / "demo", ignore_errors=True)
    (home / "demo").mkdir(parents=True)
    if not DEMO_JOB.is_file():
        raise SpotrunError(
            f"demo job {DEMO_JOB} not found: reinstall spotrun (pip install --force-reinstall)"
        )
    data = yaml.safe_load(DEMO_JOB.read_text())
    data["storage"], data["total_steps"] = str(home / "demo" / "checkpoints"), TOTAL_STEPS
    path = home / "demo" / "digits.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path, load_spec(path)


def start_reference(job: Path, root: Path) -> subprocess.Popen[bytes]:
    """The same job trained by `python -P -m spotrun.trainer` alone, uninterrupted, into its own storage."""
    root.mkdir(parents=True)
    cmd = python_m("spotrun.trainer", "--config", str(job), "--storage", str(root / "checkpoints"))
    cmd += ["--cache", str(root / "cache"), "--metrics", str(root / "metrics.jsonl")]
    env = {**OMP_WAIT, **os.environ}  # as the flow's workers: threads that sleep while they wait
    with open(root / "trainer.log", "wb") as log:
        return subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)


def losses(metrics: Path) -> dict[int, str]:
    """Per-step losses as float.hex; a resumed attempt's value overwrites the dead attempt's."""
    out: dict[int, str] = {}
    for line in metrics.read_text().splitlines():
        rec = metrics_record(line)
        if rec is not None:
            out[rec[0]] = rec[1]
    return out


def compare_final(flow: Path, ref: Path, metrics: tuple[Path, Path], *, step: int, cache: Path) -> list[str]:
    """Differences between the final states in two storages and their per-step losses; empty: equal."""
    da = fetch(open_storage(str(flow)), step, cache / "flow")
    db = fetch(open_storage(str(ref)), step, cache / "reference")
    diffs = _diff_tensors(
        "parameter", load_file(str(da / MODEL_FILE)).items(), load_file(str(db / MODEL_FILE)).items()
    )
    oa, ob = load_part(da / "optimizer.pt")["state"], load_part(db / "optimizer.pt")["state"]
    diffs += _diff_tensors("optimizer state", iter_tensors(oa), iter_tensors(ob))
    if oa["param_groups"] != ob["param_groups"]:
        diffs.append("optimizer param_groups differ")
    la, lb = losses(metrics[0]), losses(metrics[1])
    if len(lb) != step:
        diffs.append(f"the reference logged {len(lb)} of {step} per-step losses")
    diffs += [f"loss at step {s} differs" for s in sorted(set(la) | set(lb)) if la.get(s) != lb.get(s)][:5]
    return diffs


def _diff_tensors(what: str, a: Any, b: Any) -> list[str]:
    ta, tb = dict(a), dict(b)
    if ta.keys() != tb.keys():
        return [f"{what} names differ: {sorted(set(ta) ^ set(tb))[:3]}"]
    return [f"{what} {k} differs" for k in ta if not torch.equal(ta[k], tb[k])]


def run_demo(home: Path, keep_server: bool, prefect_database: str | None = None) -> bool:
    """The whole demo; True on PASS."""
    job_file, job = prepare(home)
    demo = home / "demo"
    os.environ["SPOTRUN_HOME"] = str(demo)  # read by the flow (Settings.from_env) and its workers
    os.environ["SPOTRUN_DATABASE_URL"] = default_url(home)  # the home's one history: `spotrun history`
    settings = Settings.from_env()
    every = job.checkpoint.every_steps
    console.print(f"demo job {job.name}: {job.total_steps} steps, a checkpoint every {every}, under {demo}")
    plan = ", ".join(
        f"{i} after {p.after_s} s ({'notice' if p.notice else 'no notice'})"
        for i, p in enumerate(SCHEDULE, 1)
    )
    console.print(f"spot simulator: reclaims attempt {plan} of training; then one runs undisturbed")
    started: list[subprocess.Popen[bytes]] = []
    try:
        return _run_and_check(
            home,
            job,
            job_file,
            settings=settings,
            keep_server=keep_server,
            started=started,
            prefect_database=prefect_database,
        )
    finally:
        for reference in started:
            if reference.poll() is None:  # interrupted: never leave a trainer behind
                reference.kill()
                reference.wait()


def _run_and_check(
    home: Path,
    job: JobSpec,
    job_file: Path,
    *,
    settings: Settings,
    keep_server: bool,
    started: list[subprocess.Popen[bytes]],
    prefect_database: str | None = None,
) -> bool:
    t0 = time.monotonic()
    provider = LocalProviderConfig(simulator=SpotSimulatorConfig(schedule=SCHEDULE), notice_s=NOTICE_S)
    background: Literal["reuse", "start"] = "start" if keep_server else "reuse"
    if running_server(home) is None:
        where = prefect_db.kind(
            prefect_db.server_database_url(prefect_database) if prefect_database else None
        )
        console.print(f"starting a Prefect server under {server_home(home)} ({where}) ...", markup=False)
    with prefect_api(home, use_env=False, background=background, database=prefect_database) as api:
        console.print(f"Prefect server up in {time.monotonic() - t0:.0f} s: {api.ui_url}", markup=False)
        with alerting(settings.home / "worker.log", console):
            result = run_cmd.run_job(job, provider, RetryPolicy(), settings=settings, out=console)
            run_cmd.print_result(console, result, api.flow_run_url(result.flow_run_id))
            # After the flow run, not beside it: two trainers with 2 threads each on 2 cores slow
            # both several-fold, and the reclaims are timed in seconds.
            console.print("reference: an uninterrupted `python -m spotrun.trainer` run of the same job, now")
            reference, t_ref = start_reference(job_file, settings.home / "reference"), time.monotonic()
            started.append(reference)
            failures = _plan_failures(result)
            if not failures:  # no storm to wait for when the schedule did not happen
                failures = show_alert(console, job.name, wait_for_alert(settings.database_url, job.name))
    if not failures:
        if reference.poll() is None:  # it trains as long as the flow run's attempts did, minus reclaims
            console.print("waiting for the reference run to finish ...", markup=False)
        code = reference.wait(timeout=REFERENCE_TIMEOUT_S)
        console.print(f"reference run finished in {time.monotonic() - t_ref:.0f} s", markup=False)
        if code != 0:
            failures = [f"the reference run exited {code}; see {settings.home / 'reference' / 'trainer.log'}"]
    if not failures:
        ref = settings.home / "reference"
        failures = compare_final(
            Path(job.storage),
            ref / "checkpoints",
            (result.metrics, ref / "metrics.jsonl"),
            step=job.total_steps,
            cache=settings.home / "compare",
        )
    if not failures:
        failures = show_mlflow(result, settings.home / "reference" / "metrics.jsonl", job.total_steps)
    _verdict(job, result, failures)
    _server_note(api)
    console.print(f"history: {_home_prefix(home)}{spotrun_command()} history {job.name}", markup=False)
    return not failures


def show_mlflow(result: run_cmd.RunResult, reference: Path, total: int) -> list[str]:
    """The job's MLflow run, read back: one run, one loss per step equal to the uninterrupted run's bit
    for bit, a preemption event per reclaim, the registered model; and how to browse it. Failures."""
    m = result.summary.get("mlflow") or {}
    if not m.get("run_id"):
        return [f"no MLflow run was made (MLflow at {m.get('tracking_uri', '?')} did not answer)"]
    from spotrun.tasks.tracking.mlflow_run import import_mlflow

    client = import_mlflow().MlflowClient(m["tracking_uri"])
    runs = client.search_runs([m["experiment_id"]])
    history = {h.step: h.value.hex() for h in client.get_metric_history(m["run_id"], "loss")}
    preempted = sorted(p.step for p in client.get_metric_history(m["run_id"], "spotrun/preemptions"))
    fidelity = client.get_run(m["run_id"]).data.tags.get("spotrun.resume_fidelity", "not checked")
    console.print(
        f"MLflow: {len(runs)} run in experiment {m['experiment']}: {len(history)} loss values (one per "
        f"step), preemptions at steps {preempted}, resume fidelity {fidelity}, model {m.get('model')}",
        markup=False,
    )
    console.print(f"browse it: mlflow ui --backend-store-uri {m['tracking_uri']}", markup=False)
    console.print(f"then open: {m['url']}", markup=False)
    failures = [f"{len(runs)} MLflow runs for one job run"] if len(runs) != 1 else []
    ref = losses(reference)
    if sorted(history) != list(range(1, total + 1)):
        failures.append(f"MLflow has {len(history)} loss values for {total} steps")
    elif history != ref:
        first = min(s for s in ref if history.get(s) != ref[s])
        failures.append(f"MLflow's loss differs from the uninterrupted run's at step {first}")
    if len(preempted) != len(SCHEDULE):
        failures.append(f"MLflow has {len(preempted)} preemption events for {len(SCHEDULE)} reclaims")
    return failures


def _plan_failures(result: run_cmd.RunResult) -> list[str]:
    if not result.completed:
        return [f"the flow run did not complete: {result.message}"]
    preempted = [a for a in result.attempts if a.outcome is Outcome.PREEMPTED]
    if len(preempted) < len(SCHEDULE):
        return [
            f"only {len(preempted)} of {len(SCHEDULE)} planned preemptions happened: training finished "
            "first (this machine is faster than the schedule assumes)"
        ]
    return []


def _verdict(job: JobSpec, result: run_cmd.RunResult, failures: list[str]) -> None:
    if failures:
        console.print("[bold red]FAIL[/]: " + "; ".join(failures[:8]))
        return
    preempted = sum(1 for a in result.attempts if a.outcome is Outcome.PREEMPTED)
    silent = sum(1 for p in SCHEDULE if not p.notice)
    console.print(
        f"[bold green]PASS[/]: after {preempted} preemptions ({silent} without notice), "
        f"parameters, optimizer state and all {job.total_steps} per-step losses (in the flow's metrics and "
        "in the one MLflow run) equal the uninterrupted run's bit for bit"
    )


def _server_note(api: PrefectApi) -> None:
    spotrun = spotrun_command()
    if api.server is not None:
        console.print(
            f"the Prefect server has stopped; rerun with --keep-server (or run `{spotrun} server start` "
            "first) to browse the flow run in the UI",
            markup=False,
        )
    else:
        console.print(
            f"the Prefect server keeps running at {api.ui_url}; stop it with: {spotrun} server stop",
            markup=False,
        )


def _home_prefix(home: Path) -> str:
    """`SPOTRUN_HOME=... ` when the demo's home is not the default one, for the commands it prints."""
    return "" if home == spotrun_home({}) else f"SPOTRUN_HOME={shlex.quote(str(home))} "


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m spotrun.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--keep-server",
        action="store_true",
        help="leave the Prefect server running, to browse the run in the UI",
    )
    p.add_argument(
        "--prefect-database",
        metavar="URL",
        help="keep the Prefect server's runs on this PostgreSQL database (postgresql://USER@HOST/DB) "
        "when the demo starts the server; default SQLite under $SPOTRUN_HOME/prefect",
    )
    args = p.parse_args(argv)
    home = spotrun_home()
    private_home(home)  # 0700 home, 0600 files
    t0 = time.monotonic()
    try:
        ok = run_demo(home, args.keep_server, args.prefect_database)
    except (SpotrunError, OSError, subprocess.SubprocessError) as e:  # expected: one line, no traceback
        print(f"spotrun demo: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    console.print(f"demo took {time.monotonic() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
