"""Shared fixtures. Area-specific fixtures live in each area's own conftest.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Fixture handlers (named by behaviour) live in tests/handlers and are imported as
# `tests.handlers.<name>`; make the repo root importable for subprocesses too.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture
def thaw_env(tmp_path: Path) -> dict[str, str]:
    """A clean environment for a runtime process, with state under tmp_path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("THAW_", "AWS_LAMBDA"))}
    env.update(
        {
            "THAW_CACHE_DIR": str(tmp_path / "cache"),
            "THAW_STATE_DIR": str(tmp_path / "state"),
            "THAW_JOB_STORE": f"sqlite:///{tmp_path / 'jobs.sqlite3'}",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Container image tests run last, and their image builds from the start of
    the run, in the background (tests/deploy/conftest.py)."""
    image = [item for item in items if item.get_closest_marker("image")]
    if not image:
        return
    items[:] = [item for item in items if not item.get_closest_marker("image")] + image
    from tests.deploy.conftest import start_preparing

    start_preparing()
