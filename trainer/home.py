"""SPOTRUN_HOME: one definition for the orchestrator and the trainer (a relative `storage:` lives there).

Read at each entry point (`spotrun`, `python -m spotrun.trainer`) and passed down; nothing below reads it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

HOME_SETTING = "SPOTRUN_HOME"
DEFAULT_HOME = "~/.spotrun"


def spotrun_home(environ: Mapping[str, str] | None = None) -> Path:
    """SPOTRUN_HOME as an absolute path (a relative value is taken from the current directory once,
    here); default ~/.spotrun, one per user, whatever the directory a command runs in."""
    env = os.environ if environ is None else environ
    return Path(env.get(HOME_SETTING, "").strip() or DEFAULT_HOME).expanduser().resolve()
