"""`python -m spotrun.demo` (`make demo`): preempt a training job three ways, resume it each time, and
show that it ends bit for bit where an uninterrupted run ends.

Under $SPOTRUN_HOME/demo (cleared first) it runs deployments/jobs/digits.yaml as a chain of
`python -m trainer` processes: one stopped by a notice (SIGTERM), one killed without notice
(SIGKILL at a step), one killed at an arbitrary wall-clock instant, then one that finishes. A
separate, uninterrupted reference run follows; final parameters, optimizer state and every
per-step loss must be equal (torch.equal, float.hex).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.table import Table
from safetensors.torch import load_file

from spotrun import cli
from trainer.catalog import fetch
from trainer.ckpt_format import MODEL_FILE, load_part
from trainer.errors import SpotrunError
from trainer.exitcodes import ExitCode
from trainer.spec import JobSpec, load_spec
from trainer.state import iter_tensors
from trainer.storage import open_storage

REPO = Path(__file__).resolve().parents[1]
DEMO_JOB = REPO / "deployments" / "jobs" / "digits.yaml"
ATTEMPT_TIMEOUT_S = 180.0
console = cli.wide_console()


@dataclass(frozen=True)
class Interruption:
    """One attempt of the chain and how it is meant to end."""

    label: str
    fault: str | None = None  # --inject-fault KIND@STEP
    kill_after_steps: int | None = None  # SIGKILL once this many more steps are logged (plus jitter)
    expect: int = ExitCode.COMPLETED


# Checkpoints every 25 steps: the notice checkpoints at 60 exactly, the kill at 140 loses 15 steps
# (resume from 125), the wall-clock kill lands somewhere after step ~165, inside a step or a save.
PLAN = (
    Interruption("notice: SIGTERM after step 60", fault="sigterm@60", expect=ExitCode.PREEMPTED),
    Interruption("no notice: SIGKILL after step 140", fault="sigkill@140", expect=-signal.SIGKILL),
    Interruption("SIGKILL at a wall-clock instant", kill_after_steps=40, expect=-signal.SIGKILL),
    Interruption("resume and finish"),
)


@dataclass
class Attempt:
    label: str
    code: int
    expect: int
    resumed_from: str
    reached: int | None
    seconds: float

    @property
    def as_planned(self) -> bool:
        return self.code == self.expect


@dataclass(frozen=True)
class Lane:
    """Where one sequence of attempts keeps its storage, cache, metrics and logs."""

    root: Path

    @property
    def storage(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    def log(self, n: int) -> Path:
        return self.root / "logs" / f"attempt-{n}.log"


def run_attempt(job: Path, lane: Lane, n: int, plan: Interruption) -> Attempt:
    """Start `python -m trainer`, interrupt it as planned, and read back what it did."""
    cmd = [sys.executable, "-m", "trainer", "--config", str(job), "--storage", str(lane.storage)]
    cmd += ["--cache", str(lane.root / "cache"), "--metrics", str(lane.metrics)]
    if plan.fault:
        cmd += ["--inject-fault", plan.fault]
    log_path = lane.log(n)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    before = _count_lines(lane.metrics)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=lane.root, env=_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            if plan.kill_after_steps is not None:
                _kill_when_logged(proc, lane.metrics, before + plan.kill_after_steps, t0)
            code = proc.wait(timeout=max(1.0, ATTEMPT_TIMEOUT_S - (time.monotonic() - t0)))
        finally:
            if proc.poll() is None:  # timed out or interrupted: never leave a trainer behind
                proc.kill()
                proc.wait()
    seconds, reached = time.monotonic() - t0, _last_step(lane.metrics, before)
    return Attempt(plan.label, code, plan.expect, _resumed_from(log_path.read_text()), reached, seconds)


def _env() -> dict[str, str]:
    """This environment, with the checkout importable from the trainer's working directory."""
    paths = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def _kill_when_logged(proc: subprocess.Popen[bytes], metrics: Path, lines: int, t0: float) -> None:
    while _count_lines(metrics) < lines and proc.poll() is None and time.monotonic() - t0 < ATTEMPT_TIMEOUT_S:
        time.sleep(0.005)
    time.sleep(random.uniform(0.0, 0.05))  # off the step boundary: mid-step, mid-save or mid-upload
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)


def _count_lines(p: Path) -> int:
    try:
        return p.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _last_step(metrics: Path, skip: int) -> int | None:
    try:
        lines = metrics.read_text().splitlines()[skip:]
    except FileNotFoundError:
        return None
    whole = [ln for ln in lines if ln.endswith("}")]  # a SIGKILL may cut the last line short
    return int(json.loads(whole[-1])["step"]) if whole else None


def _resumed_from(log_text: str) -> str:
    if m := re.search(r"resuming from step (\d+)", log_text):
        return f"step {m.group(1)}"
    if "no valid checkpoint" in log_text:
        return "scratch"
    if "already completed" in log_text:
        return "(already completed)"
    return "?"


def _code_name(code: int) -> str:
    if code < 0:
        return signal.Signals(-code).name
    try:
        return ExitCode(code).name
    except ValueError:
        return str(code)


def losses(metrics: Path) -> dict[int, str]:
    """Per-step losses as float.hex; a resumed attempt's value overwrites the dead attempt's."""
    out: dict[int, str] = {}
    for line in metrics.read_text().splitlines():
        if line.endswith("}"):
            rec = json.loads(line)
            out[int(rec["step"])] = rec["loss"]
    return out


def compare_final(a: Lane, b: Lane, step: int, cache: Path) -> list[str]:
    """Differences between two lanes' final states and per-step losses; empty means bitwise equal."""
    da = fetch(open_storage(str(a.storage)), step, cache / "chain")
    db = fetch(open_storage(str(b.storage)), step, cache / "reference")
    diffs = _diff_tensors(
        "parameter", load_file(str(da / MODEL_FILE)).items(), load_file(str(db / MODEL_FILE)).items()
    )
    oa, ob = load_part(da / "optimizer.pt")["state"], load_part(db / "optimizer.pt")["state"]
    diffs += _diff_tensors("optimizer state", iter_tensors(oa), iter_tensors(ob))
    if oa["param_groups"] != ob["param_groups"]:
        diffs.append("optimizer param_groups differ")
    la, lb = losses(a.metrics), losses(b.metrics)
    diffs += [f"loss at step {s} differs" for s in sorted(set(la) | set(lb)) if la.get(s) != lb.get(s)][:5]
    return diffs


def _diff_tensors(what: str, a: Any, b: Any) -> list[str]:
    ta, tb = dict(a), dict(b)
    if ta.keys() != tb.keys():
        return [f"{what} names differ: {sorted(set(ta) ^ set(tb))[:3]}"]
    return [f"{what} {k} differs" for k in ta if not torch.equal(ta[k], tb[k])]


def write_job(home: Path) -> tuple[Path, JobSpec]:
    """A copy of the demo job whose storage is under the demo directory."""
    if not DEMO_JOB.is_file():
        raise SpotrunError(f"demo job {DEMO_JOB} not found; run the demo from a checkout of spotrun")
    data = yaml.safe_load(DEMO_JOB.read_text())
    data["storage"] = str(home / "chain" / "checkpoints")
    path = home / "digits.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path, load_spec(path)


def report(attempts: list[Attempt], reference: Attempt) -> None:
    table = Table(title="attempts", title_justify="left")
    for name in ("#", "interruption", "exit", "resumed from", "last step", "seconds", "as planned"):
        table.add_column(name, justify="right" if name in ("#", "last step", "seconds") else "left")
    for i, a in enumerate([*attempts, reference], start=1):
        label = a.label if i <= len(attempts) else f"[dim]{a.label}[/]"
        ok = "[green]yes[/]" if a.as_planned else f"[red]no (expected {_code_name(a.expect)})[/]"
        table.add_row(
            str(i), label, _code_name(a.code), a.resumed_from, str(a.reached), f"{a.seconds:.1f}", ok
        )  # fmt: skip
    console.print(table)


def run_chain(job: Path, lane: Lane) -> list[Attempt]:
    """The interrupted attempts, one after another, each printed as it ends."""
    attempts = []
    for n, plan in enumerate(PLAN, start=1):
        a = run_attempt(job, lane, n, plan)
        attempts.append(a)
        console.print(
            f"  attempt {n}: {a.label:<33} -> {_code_name(a.code):<9} resumed from {a.resumed_from:<9} "
            f"reached step {a.reached} ({a.seconds:.1f}s)"
        )
    return attempts


def run_demo(home: Path) -> bool:
    """The whole demo; True on PASS."""
    demo = home / "demo"
    shutil.rmtree(demo, ignore_errors=True)
    demo.mkdir(parents=True)
    job, spec = write_job(demo)
    chain, ref = Lane(demo / "chain"), Lane(demo / "reference")
    intro = f"demo job {spec.name}: {spec.total_steps} steps, checkpoints every {spec.checkpoint.every_steps}"
    console.print(f"{intro}, under {demo}", markup=False)
    attempts = run_chain(job, chain)
    console.print("  reference: one uninterrupted run into a separate storage")
    reference = run_attempt(job, ref, 1, Interruption("uninterrupted reference"))
    report(attempts, reference)
    unplanned = [
        f"'{a.label}' ended {_code_name(a.code)}" for a in [*attempts, reference] if not a.as_planned
    ]
    diffs = unplanned or compare_final(chain, ref, spec.total_steps, demo / "compare")
    if diffs:
        console.print("[bold red]FAIL[/]: " + "; ".join(diffs[:8]))
    else:
        console.print(
            f"[bold green]PASS[/]: after {len(attempts) - 1} interruptions, parameters, optimizer state and "
            f"all {spec.total_steps} per-step losses equal the uninterrupted run's bit for bit"
        )
    where = f"checkpoints: {chain.storage} (reference: {ref.storage})\nlogs: {chain.root / 'logs'}"
    console.print(where, markup=False)
    cli.main(["checkpoints", "list", str(chain.storage)])
    return not diffs


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m spotrun.demo", description=__doc__).parse_args(argv)
    home = Path(os.environ.get("SPOTRUN_HOME") or ".spotrun").expanduser().resolve()
    t0 = time.monotonic()
    try:
        ok = run_demo(home)
    except (SpotrunError, OSError, subprocess.SubprocessError) as e:  # expected: one line, no traceback
        print(f"spotrun demo: error: {e}", file=sys.stderr)
        return 2
    console.print(f"demo took {time.monotonic() - t0:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
