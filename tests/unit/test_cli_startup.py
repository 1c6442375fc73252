"""`spotrun --help` and every sub-command's `--help` start fast: neither torch (~2 s) nor Prefect is
imported (measured 0.35-0.45 s each, against 3.8 s when `checkpoints` imported the catalog at load)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer_runs import REPO

PROBE = """
import sys
import spotrun.cli
try:
    spotrun.cli.main(sys.argv[1:])
except SystemExit:
    pass
heavy = [m for m in ("torch", "prefect", "mlflow", "sklearn") if m in sys.modules]
print("HEAVY", heavy)
"""


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["history"],
        ["checkpoints", "list"],
        ["checkpoints", "verify"],
        ["run"],
        ["deploy"],
        ["serve"],
        ["report"],
        ["server"],
        ["server", "start"],
        ["server", "status"],
    ],
)
def test_help_imports_neither_torch_nor_prefect(argv: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *argv, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert "usage: spotrun" in out.stdout, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout.splitlines()[-1]


def test_the_controller_imports_neither_torch_nor_matplotlib() -> None:
    """The controller never loads a tensor (listing, integrity checks and its flow read manifests only)
    and plots only at the end: importing it fell from 5.4 s of CPU to 2.1 s without them."""
    code = (
        "import sys, flows.resilient_training, tasks.control.loop, spotrun.run_cmd,"
        " trainer.checkpoint.catalog\n"
        "print('HEAVY', [m for m in ('torch', 'matplotlib', 'mlflow') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize(
    "argv", [["checkpoints", "list", "{empty}"], ["checkpoints", "verify", "ftp://host/x"]]
)
def test_checkpoint_commands_that_load_no_tensor_import_no_torch(argv: list[str], tmp_path: Path) -> None:
    """Listing and a bad URI answer in ~0.3 s, not the 2 s of `import torch` (measured)."""
    (tmp_path / "empty").mkdir()
    args = [a.format(empty=tmp_path / "empty") for a in argv]
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SPOTRUN_HOME": str(tmp_path / "home")},
    )
    assert "'torch'" not in out.stdout.splitlines()[-1], out.stdout + out.stderr


def test_a_missing_job_file_is_refused_before_sqlalchemy_or_prefect_load(tmp_path: Path) -> None:
    """`spotrun run nosuch.yaml` answers its one line in ~0.35 s: the job file is read first (it took
    1.16 s with SQLAlchemy imported before it)."""
    code = PROBE.replace('"sklearn")', '"sklearn", "sqlalchemy")')
    out = subprocess.run(
        [sys.executable, "-c", code, "run", str(tmp_path / "nosuch.yaml")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "cannot read job file" in out.stderr and "HEAVY []" in out.stdout, out.stdout + out.stderr
