"""Fixtures for the HTTP tests: the app in-process (tests/inproc.py), and real
`thaw serve` processes for the tests where the process is the point."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.settings import Settings
from tests.inproc import settings_for
from tests.support import ServerProcess, make_bundle


@pytest.fixture
def bundles(tmp_path: Path) -> Path:
    root = tmp_path / "bundles"
    root.mkdir()
    return root


@pytest.fixture
def server_env(thaw_env: dict[str, str], bundles: Path, tmp_path: Path) -> dict[str, str]:
    return {
        **thaw_env,
        "THAW_BUNDLE_SOURCE": str(bundles),
        "THAW_HANDLERS": "tests.handlers.loadlog,handlers.echo",
        "THAW_TEST_LOAD_LOG": str(tmp_path / "loads.log"),
        "THAW_LOG_LEVEL": "INFO",
    }


@pytest.fixture
def app_settings(bundles: Path, tmp_path: Path) -> Settings:
    """Settings for an app served in-process: the handlers `server_env` names, state
    under tmp_path. (Bundles of tests.handlers.loadlog record their loads where
    their config's `log_file` says.)"""
    return settings_for(
        tmp_path, bundle_source=str(bundles), handlers=("tests.handlers.loadlog", "handlers.echo")
    )


@pytest.fixture
def servers() -> Iterator[list[ServerProcess]]:
    """Every server a test starts is killed when it ends."""
    started: list[ServerProcess] = []
    yield started
    for server in started:
        server.kill()


@pytest.fixture
def serve(servers: list[ServerProcess], server_env: dict[str, str]):  # type: ignore[no-untyped-def]
    def start(**env: str) -> ServerProcess:
        server = ServerProcess({**server_env, **env})
        servers.append(server)
        return server.start()

    return start


__all__ = ["make_bundle"]
