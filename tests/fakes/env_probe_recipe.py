"""A recipe that writes the names and values of its trainer's environment to `args["out"]` (JSON) and
stops the trainer there (CONFIG_ERROR): what a local worker's trainer was given, seen from inside."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from spotrun.trainer.errors import ConfigError


def build(args: dict[str, Any], ctx: Any) -> Any:
    Path(args["out"]).write_text(json.dumps(dict(os.environ)))
    raise ConfigError("env probe: environment written")
