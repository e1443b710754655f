"""Fixtures shared by the job tests that run in-process on an event loop."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from runtime.jobs.stores.sqlite import SQLiteJobStore
from tests.jobs import postgres_fixtures

# The session's PostgreSQL cluster, PgBouncer before it, and an empty database per
# test, for every job test (tests/jobs/postgres_fixtures.py; they skip without them).
postgres_cluster = postgres_fixtures.postgres_cluster
pgbouncer = postgres_fixtures.pgbouncer
postgres_database = postgres_fixtures.postgres_database
_postgres_session_database = postgres_fixtures._postgres_session_database

# Without the postgres extra (psycopg) the PostgreSQL store's own tests cannot even
# be imported; the contract suite skips its PostgreSQL runs, saying why.
if importlib.util.find_spec("psycopg") is None:
    collect_ignore = ["test_postgres.py"]


@pytest.fixture
def store(tmp_path: Path) -> SQLiteJobStore:
    """A real SQLite job store in a fresh file (test modules of other stores define their own)."""
    return SQLiteJobStore(tmp_path / "jobs.sqlite3", ttl_s=60.0)
