"""The Prefect server's database URL: what `--database` and SPOTRUN_PREFECT_DATABASE_URL accept, the
driver the server is given, and the one-line refusals (password hidden)."""

from __future__ import annotations

from pathlib import Path

import pytest

from spotrun import prefect_db
from spotrun.server import PrefectServer, configured_database
from spotrun.trainer.errors import ConfigError


@pytest.mark.parametrize(
    ("given", "server_gets"),
    [
        (
            "postgresql://postgres@127.0.0.1:5432/prefect",
            "postgresql+asyncpg://postgres@127.0.0.1:5432/prefect",
        ),
        ("postgres://u:pw@db/prefect", "postgresql+asyncpg://u:pw@db/prefect"),
        ("postgresql+psycopg://u@db/prefect", "postgresql+asyncpg://u@db/prefect"),  # the history's form
        ("postgresql+asyncpg://u@db/prefect", "postgresql+asyncpg://u@db/prefect"),
        (" sqlite:////tmp/p.db ", "sqlite+aiosqlite:////tmp/p.db"),
    ],
)
def test_urls_get_the_servers_driver(given: str, server_gets: str) -> None:
    assert prefect_db.server_database_url(given) == server_gets


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("mysql://u:s3cret@db/prefect", "mysql is not supported"),
        ("postgresql://u:s3cret@db", "name the database"),
        ("not a url", "not a URL"),
    ],
)
def test_other_urls_are_refused_in_one_line_without_the_password(given: str, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        prefect_db.server_database_url(given)
    assert says in str(e.value) and "s3cret" not in str(e.value) and "\n" not in str(e.value)


def test_the_server_is_given_its_database_and_shows_it_without_the_password(tmp_path: Path) -> None:
    server = PrefectServer(tmp_path, 4999, database="postgresql://u:s3cret@127.0.0.1/prefect")
    assert (
        server.server_env()[prefect_db.PREFECT_SETTING] == "postgresql+asyncpg://u:s3cret@127.0.0.1/prefect"
    )
    assert "s3cret" not in server.database_shown and "***" in server.database_shown
    assert prefect_db.PREFECT_SETTING not in PrefectServer(tmp_path, 4999).server_env()  # SQLite in its home


def test_the_environment_names_the_database() -> None:
    assert configured_database({prefect_db.ENV: " postgresql://u@h/db "}) == "postgresql://u@h/db"
    assert configured_database({prefect_db.ENV: ""}) is None and configured_database({}) is None
