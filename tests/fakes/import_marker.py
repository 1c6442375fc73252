"""Importing this module is the event a test watches for: it writes the file SPOTRUN_TEST_IMPORT_MARKER
names. A checkpoint whose embedded spec names `tests.fakes.import_marker:build` must never get here."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

Path(os.environ["SPOTRUN_TEST_IMPORT_MARKER"]).write_text("imported\n")


def build(args: dict[str, Any], ctx: Any) -> Any:
    raise RuntimeError("never built")
