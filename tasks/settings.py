"""Where the orchestrator keeps its files and its history: read from the environment once, at the edge."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tasks.history import database_url


@dataclass(frozen=True)
class Settings:
    home: Path  # SPOTRUN_HOME: local checkpoints cache, worker directories, history.db, journal/, reports
    database_url: str  # SPOTRUN_DATABASE_URL, default sqlite:///<home>/history.db

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        home = Path(env.get("SPOTRUN_HOME", ".spotrun")).expanduser().resolve()
        return cls(home, database_url(env, home))

    @property
    def journal_dir(self) -> Path:
        """Where history writes wait while the database is down (one file per database URL)."""
        return self.home / "journal"

    def job_dir(self, job: str) -> Path:
        return self.home / "jobs" / job
