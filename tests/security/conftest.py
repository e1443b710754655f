"""Fixtures for the security tests: the app in-process (tests/inproc.py), and real
`thaw serve` processes on 127.0.0.1 where uvicorn's own handling of connections or
the process is what a test is about.

Servers here are module scoped (one serves every test of a module that only
reads from it), and each is stopped when its module ends.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
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


# schemathesis's console entry point, run by this interpreter (no PATH lookup).
SCHEMATHESIS = [sys.executable, "-c", "from schemathesis.cli import schemathesis; schemathesis()"]


def run_schemathesis(
    url: str,
    workdir: Path,
    config: str,
    *,
    phases: tuple[str, ...],
    max_examples: int,
    key: str | None = None,
    extra: tuple[str, ...] = (),
    timeout_s: float = 300,
) -> str:
    """`schemathesis run` of the document at `url` as a user runs it: every check,
    seeded, one worker, no example database; it must exit 0 with every phase
    passed. Returns its report."""
    config_file = workdir / "schemathesis.toml"
    config_file.write_text(config)
    command = [*SCHEMATHESIS, "--config-file", str(config_file), "--no-color", "run"]
    command += [f"{url}/openapi.json", "--checks", "all", "--phases", ",".join(phases)]
    command += ["--max-examples", str(max_examples), "--seed", "1", "--workers", "1"]
    command += ["--generation-database", "none", "--request-timeout", "30", *extra]
    if key is not None:
        command += ["--header", f"Authorization: Bearer {key}"]
    done = subprocess.run(
        command, cwd=workdir, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    report = done.stdout + done.stderr
    assert done.returncode == 0, report[-8000:]
    for phase in phases:
        assert f"✅ {phase.capitalize()}" in report, report[-4000:]
    return report
