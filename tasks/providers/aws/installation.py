"""This spotrun installation's id: the `spotrun:installation` tag on every instance it launches, which
its sweeper requires (it never touches another installation's instances in the same account) and its
IAM policy's launch and terminate conditions name (iam.py).

Generated once, at the first EC2 launch or sweep, and kept in a 0600 file under SPOTRUN_HOME: the
controller and the sweeper of one installation share the home, so they share the id.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from spotrun.trainer.errors import ConfigError

INSTALLATION_FILE = "aws-installation-id"
_ID = re.compile(r"^[0-9a-f]{16}$")


def installation_id(home: Path) -> str:
    """The id in `home`, made there first if there is none. ConfigError, one line, for a file that
    holds something else."""
    path = home / INSTALLATION_FILE
    if not path.exists():
        _create(path)
    found = path.read_text().strip()
    if not _ID.match(found):
        raise ConfigError(
            f"{path} does not hold an installation id (16 hex digits): restore it, or delete it if no "
            "EC2 worker of this installation runs (its sweeper would no longer see them)"
        )
    return found


def _create(path: Path) -> None:
    """Write a new id to a private temporary file and link it into place: of two processes that race,
    one id wins and both read it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(8) + "\n")
        os.link(tmp, path)
    except FileExistsError:
        pass  # another process made it first: its id stands
    finally:
        tmp.unlink(missing_ok=True)
