"""Where the orchestrator keeps its files and its history: read from the environment once, at the edge.

SPOTRUN_HOME (default ~/.spotrun) holds the history database, the journal, the background Prefect
server, worker directories and caches, and every relative `storage:` of a job: the same job file names
the same checkpoints and the same history from any directory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from spotrun.trainer.home import spotrun_home  # shared with `python -m spotrun.trainer`

if TYPE_CHECKING:
    from spotrun.trainer.spec.job import JobSpec


@dataclass(frozen=True)
class Settings:
    home: Path  # SPOTRUN_HOME: local checkpoints cache, worker directories, history.db, journal/, reports
    database_url: str  # SPOTRUN_DATABASE_URL, default sqlite:///<home>/history.db

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        from spotrun.tasks.history import database_url  # SQLAlchemy: not for commands that never read history

        env = os.environ if environ is None else environ
        home = spotrun_home(env)
        return cls(home, database_url(env, home))

    @property
    def journal_dir(self) -> Path:
        """Where history writes wait while the database is down (one file per database URL)."""
        return self.home / "journal"

    def job_dir(self, job: str, run_key: str | None = None) -> Path:
        """The controller's files of a job (a keyed job's run: `runs/<key>` below it)."""
        return self.home / "jobs" / job / "runs" / run_key if run_key else self.home / "jobs" / job

    def resolve(self, job: JobSpec) -> JobSpec:
        """The job with its storage made absolute (a relative path is under SPOTRUN_HOME): done once
        where a spec enters the orchestrator, so the trainer, the cache key and the history all see one
        location."""
        from spotrun.trainer.storage import resolve_uri

        storage = resolve_uri(job.storage, self.home)
        return job if storage == job.storage else job.model_copy(update={"storage": storage})
