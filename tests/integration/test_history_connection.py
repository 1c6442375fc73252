"""The history database's connection settings: TLS off loopback, statement and TCP timeouts."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from spotrun.tasks.history.engine import (
    STATEMENT_TIMEOUT_MS,
    check_database_url,
    make_engine,
    normalize_url,
    pg_connect_args,
    sslmode,
)
from spotrun.tasks.history.migrations import _lock
from spotrun.trainer.errors import ConfigError
from tests.integration.databases import new_schema, pg_url

REMOTE = "postgresql://u:s3cret@db.example.com/h"

SSLMODES = [  # (URL, the sslmode connections use; None: libpq's default)
    ("postgresql://u@127.0.0.1/h", None),
    ("postgresql://u@localhost:5433/h", None),
    ("postgresql://u@[::1]/h", None),
    ("postgresql://u@127.0.0.1/h?sslmode=disable", "disable"),  # loopback keeps today's behaviour
    ("postgresql://u@/h?host=/var/run/postgresql", None),  # a Unix socket
    ("postgresql://u@/h", None),  # libpq's default socket
    (REMOTE, "verify-full"),
    ("postgresql://u@10.0.0.5/h", "verify-full"),
    ("postgresql://u@127.0.0.1/h?host=db.example.com", "verify-full"),  # any host off loopback counts
    (REMOTE + "?sslmode=verify-full&sslrootcert=/etc/ca.pem", "verify-full"),
]


@pytest.mark.parametrize(("url", "mode"), SSLMODES)
def test_sslmode(url: str, mode: str | None) -> None:
    assert sslmode(normalize_url(url)) == mode
    args = pg_connect_args(normalize_url(url), 5)
    assert args.get("sslmode") == (mode if "sslmode" not in url else None)  # the URL's own stays the URL's


@pytest.mark.parametrize("weak", ["disable", "allow", "prefer", "require", "verify-ca"])
def test_a_weaker_sslmode_off_loopback_is_refused_in_one_line(weak: str) -> None:
    with pytest.raises(ConfigError) as e:
        check_database_url(f"{REMOTE}?sslmode={weak}")
    msg = str(e.value)
    assert f"sslmode={weak}" in msg and "sslmode=verify-full" in msg and "\n" not in msg
    assert "s3cret" not in msg


TIMEOUT = f"-c statement_timeout={STATEMENT_TIMEOUT_MS}"
ARGS = [  # (URL query, what connect_args hold besides connect_timeout)
    ("", {"options": TIMEOUT}),
    ("?options=-csearch_path%3Dx", {"options": f"{TIMEOUT} -csearch_path=x"}),  # the URL's last: they win
    ("?keepalives_idle=5", {"keepalives_idle": None}),  # the URL's own is left to the URL
]


@pytest.mark.parametrize(("query", "expect"), ARGS)
def test_connect_args(query: str, expect: dict[str, object]) -> None:
    args = pg_connect_args(normalize_url(f"postgresql://u@127.0.0.1/h{query}"), 5)
    assert args["connect_timeout"] == 5
    assert args.get("keepalives") == 1 and args.get("tcp_user_timeout") == 60_000
    for key, value in expect.items():
        assert args.get(key) == value


def test_a_real_connection_has_the_timeouts_and_a_migration_has_none(pg_database: str) -> None:
    engine = make_engine(normalize_url(pg_url(pg_database, new_schema(pg_database))), 5)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SHOW statement_timeout")).scalar() == f"{STATEMENT_TIMEOUT_MS // 1000}s"
            assert conn.execute(text("SHOW search_path")).scalar() != "public"  # the URL's options kept
            params = conn.connection.dbapi_connection.info.get_parameters()  # type: ignore[union-attr]
            assert params["keepalives_idle"] == "30" and params["tcp_user_timeout"] == "60000"
            _lock(conn)
            assert conn.execute(text("SHOW statement_timeout")).scalar() == "0"
            conn.rollback()
            assert conn.execute(text("SHOW statement_timeout")).scalar() == f"{STATEMENT_TIMEOUT_MS // 1000}s"
    finally:
        engine.dispose()
