"""The history databases as fixtures for every integration module (defined in `databases.py`)."""

from tests.integration.databases import backend, db_url, outage, pg_database

__all__ = ["backend", "db_url", "outage", "pg_database"]
