"""spotrun's local Prefect server for the tests, started from an already migrated database.

A server on an empty SQLite file spends 12 s (on 2 cores) creating and migrating its tables; on a
migrated copy it answers in 4 s (measured). The suite starts about ten servers, so each starts from
a template made once per Prefect version: one server started and stopped, its database copied with
SQLite's backup API (the WAL folded in). Everything a server keeps of its runs starts empty, as on a
fresh machine; only the schema and the block types it registers at start are already there.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
from pathlib import Path

from spotrun import server as _server
from spotrun.server import free_port  # noqa: F401 (re-exported for the tests)
from spotrun.trainer.storage.locks import flock_within

DATABASE = "prefect.db"
MEMO = "memo_store.toml"  # the block types' registration hash: without it the server registers again


def _template_root() -> Path:
    import prefect

    return Path(tempfile.gettempdir()) / f"spotrun-test-prefect-{prefect.__version__}-{os.getuid()}"


def template() -> Path:
    """The migrated template's directory (made now by the first caller; others wait on a lock)."""
    root = _template_root()
    root.mkdir(parents=True, exist_ok=True)
    with flock_within(root / "lock", 300, "the test servers' template database"):
        if not (root / DATABASE).is_file():
            work = Path(tempfile.mkdtemp(dir=root))
            server = _server.PrefectServer(work)
            server.start()
            server.stop()
            src, dst = sqlite3.connect(work / DATABASE), sqlite3.connect(work / "copy.db")
            with dst:
                src.backup(dst)
            src.close()
            dst.close()
            if (work / MEMO).is_file():
                shutil.copyfile(work / MEMO, root / MEMO)
            os.replace(work / "copy.db", root / DATABASE)  # last: a complete template or none
            shutil.rmtree(work, ignore_errors=True)
    return root


def seed(prefect_home: Path) -> Path:
    """Give a server home that has no database yet a copy of the template; `prefect_home` returned.
    Private, as spotrun makes its own: the directory 0700, the copies 0600 (its auth string and key
    files are the server's own, made when it starts)."""
    prefect_home.mkdir(parents=True, exist_ok=True)
    prefect_home.chmod(0o700)
    if not (prefect_home / DATABASE).exists():
        root = template()
        for name in (DATABASE, MEMO):
            if (root / name).is_file():
                shutil.copyfile(root / name, prefect_home / name)
                (prefect_home / name).chmod(0o600)
    return prefect_home


class PrefectServer(_server.PrefectServer):
    """spotrun's server, its home seeded from the template before it starts (on SQLite; on PostgreSQL
    its database is made from a migrated one: tests/prefect_postgres.py)."""

    def spawn(self):  # type: ignore[no-untyped-def]
        if self.database is None:
            seed(self.home)
        return super().spawn()
