"""A Prefect server shared by the end-to-end modules that run flows (test_alerts.py starts its own: its
automations must not see other modules' events)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.prefect_server import PrefectServer


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """SPOTRUN_HOME for the flow (its history.db lives there), SPOTRUN_DATABASE_URL unset."""
    monkeypatch.setenv("SPOTRUN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SPOTRUN_DATABASE_URL", raising=False)
    return tmp_path / "home"


@pytest.fixture(scope="package")
def prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = PrefectServer(tmp_path_factory.mktemp("prefect")).start()
    try:
        with server.clients():  # its URL and auth string, here and in the processes tests start
            yield server.api_url
            from prefect.logging.handlers import APILogHandler

            APILogHandler().flush()  # the last run's logs, before the server goes
    finally:
        server.stop()
