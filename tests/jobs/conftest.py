"""Fixtures shared by the job tests that run in-process on an event loop."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.jobs.stores.sqlite import SQLiteJobStore


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def store(tmp_path: Path) -> SQLiteJobStore:
    """A real SQLite job store in a fresh file (test modules of other stores define their own)."""
    return SQLiteJobStore(tmp_path / "jobs.sqlite3", ttl_s=60.0)
