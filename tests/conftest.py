"""Shared fixtures. Area-specific fixtures live in each area's own conftest.py.

Two tiers: `make test` runs everything; `make test-fast` only what runs in this
process (`-m "not process and not image and not slow"`). A test that starts a
process (a server, the emulator, PostgreSQL, moto, a mount) is marked `process`:
by `pytestmark` or its own mark, or here, for using one of `PROCESS_FIXTURES`.
Under `make test-fast` (THAW_TESTS_IN_PROCESS=1) starting a process raises, and
the test fails naming what it started, so the fast tier stays what it says.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Fixture handlers (named by behaviour) live in tests/handlers and are imported as
# `tests.handlers.<name>`; make the repo root importable for subprocesses too.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# Fixtures that start a process, or stand for one (its environment): a test that
# uses one, directly or through another fixture, is marked `process`. Names
# that mean a process in one module and an in-process app in another (`server`,
# `emulator`, `dsn`) are left to those modules' own marks.
PROCESS_FIXTURES = frozenset(
    {
        "thaw_env",  # the environment of a runtime process
        "server_env",
        "servers",
        "serve",
        "serve_at",
        "start_runtime",
        "emulator_env",
        "state_env",
        "lambda_client",
        "clean_env",
        "launch",
        "launch_module",
        "start_servers",
        "moto_endpoint",
        "aws_env",
        "postgres_cluster",
        "postgres_database",
        "pgbouncer",
        "own_cluster",
        "fleet_dsn",
        "fleet_env",
        "make_fleet",
        "read_only_fs",  # mount(8)
        "small_disk",  # a tmpfs
        "bundle_fs",
        "engine",  # buildah / podman
        "session_images",
        "built_images",
        "built_image",
        "http_image",
        "minilm_bundle",  # built by scripts/build_model_bundles.py
        "smollm2_bundle",
        "efficientnet_bundle",
    }
)

# A parametrized test whose parameter is one of these stores talks to its server.
PROCESS_PARAMS = frozenset({"postgres", "pgbouncer", "dynamodb"})

# Audit events of starting a process (sys.addaudithook), watched under `make test-fast`.
_SPAWN_EVENTS = frozenset(
    {"subprocess.Popen", "os.posix_spawn", "os.spawn", "os.exec", "os.fork", "os.system"}
)
# What a library runs for itself, once per process (`platform.processor()` asks uname).
_ALLOWED = frozenset({"uname", "/usr/bin/uname", "/bin/uname"})
IN_PROCESS_ONLY = os.environ.get("THAW_TESTS_IN_PROCESS") == "1"
# What was started since the last test's end (`in_process_only`).
_started: list[str] = []


def _program(executable: Any, argv: Any) -> str:
    if executable is not None:
        return str(executable)
    if isinstance(argv, str | bytes | os.PathLike):
        return str(argv).split(" ", 1)[0]
    return str(next(iter(argv), ""))


def _audit(event: str, args: tuple[Any, ...]) -> None:
    """Refuses to start a process (at once: nothing waits for one that never comes),
    and keeps what it was for the test's failure."""
    if event in _SPAWN_EVENTS:
        if event == "subprocess.Popen" and _program(args[0], args[1]) in _ALLOWED:
            return
        what = args[1] if event == "subprocess.Popen" else args[:1]
        _started.append(f"{event} {str(what)[:160]}")
        raise RuntimeError(f"{_started[-1]}: a process in the in-process tier")


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
    # Where tests run: in a worker, or in a run without workers (the controller of
    # `-n 2` starts its workers as processes, and runs no test).
    runs_tests = workerinput is not None or not getattr(config.option, "numprocesses", None)
    if IN_PROCESS_ONLY and runs_tests:
        sys.addaudithook(_audit)


# Set on a test whose call failed (`pytest_runtest_makereport`).
_CALL_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call" and report.failed:
        item.stash[_CALL_FAILED] = True
    return report


@pytest.fixture(autouse=True)
def in_process_only(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under `make test-fast`: fail a test that started a process (in its own set-up,
    a shared fixture's made for it, its body or its teardown) unmarked `process`,
    where the refusal itself did not fail it already (a thread's, or one caught)."""
    _started.clear()  # a shared fixture refused before this test: its set-up failed then
    yield
    if IN_PROCESS_ONLY and _started:
        started = list(_started)
        _started.clear()
        if request.node.stash.get(_CALL_FAILED, False):
            return
        pytest.fail(
            f"started a process ({started[0]}; {len(started)} in all) in the in-process "
            "tier: mark the test `process` (tests/conftest.py)",
            pytrace=False,
        )


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


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by the marks added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that use a process's fixture are marked `process`. Tests marked `gpu`
    are skipped where no CUDA device is (they run on a device machine: `pytest -m
    gpu`). Container image tests run last, and their image builds from the start
    of the run, in the background (tests/deploy/conftest.py)."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = set(callspec.id.split("-")) if callspec is not None else set()
        if not PROCESS_FIXTURES.isdisjoint(getattr(item, "fixturenames", ())) or (
            params & PROCESS_PARAMS
        ):
            item.add_marker(pytest.mark.process)
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
