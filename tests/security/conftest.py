"""Fixtures for the security tests: the app in-process (tests/inproc.py), and real
`thaw serve` processes on 127.0.0.1 where uvicorn's own handling of connections or
the process is what a test is about.

Servers here are module scoped (one serves every test of a module that only
reads from it), and each is stopped when its module ends.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from runtime.settings import Settings
from tests.inproc import settings_for
from tests.support import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
PROBLEM = "application/problem+json"
# Model-less handlers: serving them never imports torch, so servers start fast.
LIGHT_HANDLERS = "handlers.echo,tests.handlers.raises"

Launch = Callable[..., ServerProcess]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """asyncio, for the module: a module's in-process app lives on one event loop."""
    return "asyncio"


def light_settings(root: Path, **overrides: object) -> Settings:
    """In-process settings as `clean_env` gives a server: state under `root`,
    model-less handlers."""
    (root / "bundles").mkdir(exist_ok=True)
    values: dict[str, object] = {"handlers": tuple(LIGHT_HANDLERS.split(","))}
    values.update(overrides)
    return settings_for(root, **values)


def clean_env(root: Path) -> dict[str, str]:
    """A runtime environment with every piece of state under `root`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("THAW_", "AWS_LAMBDA"))}
    env.update(
        {
            "THAW_CACHE_DIR": str(root / "cache"),
            "THAW_STATE_DIR": str(root / "state"),
            "THAW_JOB_STORE": f"sqlite:///{root / 'jobs.sqlite3'}",
            "THAW_BUNDLE_SOURCE": str(root / "bundles"),
            "THAW_HANDLERS": LIGHT_HANDLERS,
            "THAW_LOG_LEVEL": "INFO",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def start_servers(tmp_root: Callable[[], Path]) -> Iterator[Launch]:
    started: list[ServerProcess] = []

    def launch(**env: str) -> ServerProcess:
        root = tmp_root()
        (root / "bundles").mkdir(exist_ok=True)
        server = ServerProcess({**clean_env(root), **env})
        started.append(server)
        return server.start()

    yield launch
    for server in started:
        server.kill()


@pytest.fixture(scope="module")
def launch_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launch]:
    """Start servers that live until the module's last test."""
    yield from start_servers(lambda: tmp_path_factory.mktemp("server"))


@pytest.fixture
def launch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launch]:
    """Start servers that live for one test."""
    yield from start_servers(lambda: tmp_path_factory.mktemp("server"))


def key_id_of(key: str) -> str:
    """What the runtime calls a key: a sha256 prefix (computed here independently)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
