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


def pytest_configure(config: pytest.Config) -> None:
    """Test processes run side by side (`-n 2` on 2 cores in CI), and the servers
    they start with them: each gets its share of the cores for torch's loops, as
    several instances on one host should (docs/configuration.md). Past that, each
    process's OpenMP workers spin for the cores the others need
    (runtime/models/weights/teams.py). Before any test module imports torch."""
    cores = os.cpu_count() or 1
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:  # a worker: set already, by the controller it inherits from
        processes = int(workerinput["workercount"])
    else:
        asked = getattr(config.option, "numprocesses", None)  # xdist's -n: a count, or 'auto'
        processes = asked if isinstance(asked, int) and asked > 0 else cores if asked else 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // processes)))


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """Every `pytest.mark.anyio` test runs on asyncio (the runtime's loop). Module
    scope, so that a module's async fixtures (an in-process app) may be too."""
    return "asyncio"


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


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` are skipped where no CUDA device is (they run on a device
    machine: `pytest -m gpu`). Container image tests run last, and their image
    builds from the start of the run, in the background (tests/deploy/conftest.py)."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu and not _has_cuda():  # torch is imported only when a gpu test is collected
        skip = pytest.mark.skip(reason="needs a CUDA device (runs on a device machine)")
        for item in gpu:
            item.add_marker(skip)
    image = [item for item in items if item.get_closest_marker("image")]
    if image:
        items[:] = [item for item in items if not item.get_closest_marker("image")] + image


def pytest_collection_finish(session: pytest.Session) -> None:
    """The image starts building once the run's tests are known: after `-m`,
    `-k` or `--deselect` have had their say, so a run without image tests
    builds nothing."""
    # Under pytest-xdist every worker collects every test; one of them (gw0)
    # starts early, and a worker that gets the image tests otherwise starts when
    # it needs them (tests/deploy/conftest.py holds a lock across workers).
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return
    if any(item.get_closest_marker("image") for item in session.items):
        from tests.deploy.conftest import start_preparing

        start_preparing()
