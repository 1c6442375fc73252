"""The commands the demo prints run as printed: `spotrun` only where PATH finds this environment's script,
else the script's path (after `make demo` it is in .venv/bin, which is not on PATH)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from spotrun.console import spotrun_command

SCRIPT = Path(sys.executable).parent.resolve() / "spotrun"
pytestmark = pytest.mark.skipif(not SCRIPT.is_file(), reason=f"no spotrun script beside {sys.executable}")


def test_bare_name_when_path_finds_this_script(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(SCRIPT.parent))
    assert spotrun_command(tmp_path) == "spotrun"


def test_the_scripts_path_when_path_does_not(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there; another `spotrun` would do the same
    venv = SCRIPT.parents[1]
    assert spotrun_command(venv.parent) == f"{venv.name}/bin/spotrun"  # from the repo: .venv/bin/spotrun
    assert spotrun_command(SCRIPT.parent) == "./spotrun"  # a bare name would search PATH
    assert spotrun_command(tmp_path) == shlex.quote(str(SCRIPT))
