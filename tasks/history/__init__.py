"""Restart history in SQL: job runs, attempts, checkpoint rejections and alerts (no Prefect here)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from spotrun.tasks.history.engine import default_url
from spotrun.tasks.history.models import AlertRow, AlertStatus, AttemptRow, JobRunRow, JobStatus, RejectionRow
from spotrun.tasks.history.store import HistoryStore, StoreUnavailable

__all__ = [
    "AlertRow",
    "AlertStatus",
    "AttemptRow",
    "HistoryStore",
    "JobRunRow",
    "JobStatus",
    "RejectionRow",
    "StoreUnavailable",
    "database_url",
    "default_url",
]

URL_SETTING = "SPOTRUN_DATABASE_URL"


def database_url(environ: Mapping[str, str], home: Path) -> str:
    """The history database URL: SPOTRUN_DATABASE_URL when set, else a SQLite file in `home`."""
    return environ.get(URL_SETTING, "").strip() or default_url(home)
