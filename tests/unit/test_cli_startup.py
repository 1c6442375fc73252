"""`spotrun --help` and every sub-command's `--help` start fast: neither torch (~2 s) nor Prefect is
imported (measured 0.35-0.45 s each, against 3.8 s when `checkpoints` imported the catalog at load)."""

from __future__ import annotations

import subprocess
import sys

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
    [[], ["history"], ["checkpoints", "list"], ["checkpoints", "verify"], ["run"], ["deploy"], ["serve"],
     ["report"], ["server"], ["server", "start"], ["server", "status"]],
)  # fmt: skip
def test_help_imports_neither_torch_nor_prefect(argv: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *argv, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert "usage: spotrun" in out.stdout, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout.splitlines()[-1]
