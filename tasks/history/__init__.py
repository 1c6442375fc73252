"""Restart history in SQL: job runs, attempts, checkpoint rejections and alerts (no Prefect here)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from spotrun.tasks.history.engine import default_url
from spotrun.tasks.history.models import AlertRow as AlertRow
from spotrun.tasks.history.models import AlertStatus as AlertStatus
from spotrun.tasks.history.models import AttemptRow as AttemptRow
from spotrun.tasks.history.models import JobRunRow as JobRunRow
from spotrun.tasks.history.models import JobStatus as JobStatus
from spotrun.tasks.history.models import RejectionRow as RejectionRow
from spotrun.tasks.history.store import HistoryStore as HistoryStore
from spotrun.tasks.history.store import StoreUnavailable as StoreUnavailable

URL_SETTING = "SPOTRUN_DATABASE_URL"


def database_url(environ: Mapping[str, str], home: Path) -> str:
    """The history database URL: SPOTRUN_DATABASE_URL when set, else a SQLite file in `home`."""
    return environ.get(URL_SETTING, "").strip() or default_url(home)
