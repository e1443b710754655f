"""The container image, built once per session from the checkout, and its figures.

scripts/image.py does the work a human does by hand (docs/containers.md, "This
repository's images without Docker"): the tools (apt-get installs missing ones,
as root), the stand-in base image, the wheelhouse, a build with no network. The base image's tarball
and the wheelhouse are cached under THAW_IMAGE_CACHE (default .thaw/image), and
the image store keeps the layers: the second build in a CI run, or on a
developer's machine, is a cached one. Kept on purpose: the stand-in base image,
the images `localhost/thaw-test:latest` (the Lambda image, the Dockerfile's
default target), `:http` (its `http` target) and `:gpu-stand-in` (their layers
are the next run's cache). Removed: every container a test starts (label
io.thaw.test), and the image built only to time a rebuild.

The figures (build times, image size and largest layers, start -> /healthz, the
Lambda-mode cold REPORT) are printed at the end of the run and written to
.thaw/image/figures.json; nothing asserts on them.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

from scripts import image as image_script

ROOT = Path(__file__).resolve().parents[2]
TAG = "localhost/thaw-test:latest"
HTTP_TAG = "localhost/thaw-test:http"
GPU_TAG = "localhost/thaw-test:gpu-stand-in"
TEST_LABEL = "io.thaw.test"
FIGURES: dict[str, Any] = {}
# What the Dockerfile reads from its build context.
CONTEXT = ("Dockerfile", ".dockerignore", "pyproject.toml", "README.md", "runtime", "handlers")


@dataclass(frozen=True)
class Engine:
    """podman with the environment scripts/image.py set up (containers.conf)."""

    env: dict[str, str]

    def __call__(
        self, *args: str, timeout_s: float = 120.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            ["podman", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)}: exit {done.returncode}\n{done.stderr}")
        return done

    def remove_test_containers(self, *, owner: int | None = None) -> None:
        """This process's test containers, or (owner None) those of processes now gone.

        Each pytest-xdist worker owns the containers it labels: removing every
        labelled one would kill another worker's container mid-test.
        """
        fmt = f'{{{{.ID}}}} {{{{index .Labels "{TEST_LABEL}"}}}}'
        listed = self("ps", "-a", "--filter", f"label={TEST_LABEL}", "--format", fmt, check=False)
        ids = [
            cid
            for cid, _, label in (line.partition(" ") for line in listed.stdout.splitlines())
            if (label == str(owner) if owner is not None else not _alive(label))
        ]
        if ids:
            self("rm", "-f", "-t", "0", *ids, check=False)


def _alive(label: str) -> bool:
    try:
        os.kill(int(label), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def owned_label() -> str:
    """`--label` for a container this process starts (remove_test_containers)."""
    return f"{TEST_LABEL}={os.getpid()}"


def record(name: str, value: Any) -> None:
    FIGURES[name] = value
    path = image_script.cache_dir() / "figures.json"
    path.write_text(json.dumps(FIGURES, indent=2, default=str) + "\n")


@dataclass
class Prepared:
    """What the session's image work produced: the engine and the two images, or
    why the tools cannot run here."""

    engine: Engine | None = None
    images: dict[str, str] | None = None
    skip_reason: str | None = None


_PREPARING: concurrent.futures.Future[Prepared] | None = None


def start_preparing() -> None:
    """Start the tools, base, wheelhouse and both builds in the background now.

    The root conftest calls this when the run has image tests, and runs those
    last: a cold build (minutes, mostly waiting on the mirror, dpkg and pip)
    then overlaps the rest of the suite instead of adding to it. The worker
    thread is not a daemon: the run waits for it rather than leave a build
    running behind it.
    """
    global _PREPARING
    if _PREPARING is None:
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="image-prepare")
        _PREPARING = pool.submit(_prepare)
        pool.shutdown(wait=False)


def _prepare() -> Prepared:
    # Under pytest-xdist each worker is a process of its own: the one that runs the
    # image tests may not be the one that started building early. The lock makes
    # the second wait for the first and then find every layer in the cache.
    with (image_script.cache_dir() / "prepare.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _prepare_locked()


def _prepare_locked() -> Prepared:
    started = time.monotonic()
    try:
        image_script.ensure_tools()
    except image_script.Unavailable as exc:
        return Prepared(skip_reason=f"container image tests: {exc}")
    record("tools_s", round(time.monotonic() - started, 1))
    # The base (debootstrap: mostly waiting on the mirror and dpkg) and the wheelhouse
    # (pip download) need nothing of each other.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        base = pool.submit(_timed, image_script.ensure_base)
        wheels = pool.submit(_timed, lambda: image_script.ensure_wheels()[1])
        record("base", base.result())
        record("wheelhouse", wheels.result())
    engine = Engine(image_script.engine_env())
    engine.remove_test_containers()  # a run that was killed may have left some
    # Dockerfile, and Dockerfile.gpu on the stand-in base, side by side: each is
    # mostly one busy thread (pip, then the layer's commit).
    builds = {
        TAG: (ROOT / "Dockerfile", []),
        GPU_TAG: (ROOT / "Dockerfile.gpu", [f"BASE_IMAGE={image_script.BASE_TAG}"]),
    }
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(builds)) as pool:
        futures = {
            tag: pool.submit(image_script.build, dockerfile, tag, args)
            for tag, (dockerfile, args) in builds.items()
        }
        figures = {tag: future.result() for tag, future in futures.items()}
    record("builds_side_by_side_s", round(time.monotonic() - started, 1))
    # The `http` target is the Lambda image's stages plus a USER: built after them,
    # it is one cached step (side by side, both builds would run every step).
    http = image_script.build(ROOT / "Dockerfile", HTTP_TAG, [], target="http")
    record("http_target_build_s", http.build_s)
    record("build", asdict(figures[TAG]))
    record(
        "gpu_stand_in_build",
        {"build_s": figures[GPU_TAG].build_s, "size_bytes": figures[GPU_TAG].size_bytes},
    )
    return Prepared(engine=engine, images={"cpu": TAG, "http": HTTP_TAG, "gpu": GPU_TAG})


def _prepared() -> Prepared:
    start_preparing()  # when only some image tests were collected, as with -k
    assert _PREPARING is not None
    return _PREPARING.result()


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    """The tools, the stand-in base and the wheelhouse; skips where they cannot be had."""
    prepared = _prepared()
    if prepared.engine is None:
        pytest.skip(prepared.skip_reason or "container image tests cannot run here")
    yield prepared.engine
    prepared.engine.remove_test_containers(owner=os.getpid())


@pytest.fixture(scope="session")
def session_images(engine: Engine) -> dict[str, str]:
    """The images the session built ("cpu": the Lambda image, "http", "gpu"), without
    the rebuild figure: for test modules that only run them."""
    images = _prepared().images
    assert images is not None
    return images


@pytest.fixture(scope="session")
def built_images(
    session_images: dict[str, str], engine: Engine, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    """Dockerfile (both targets), and Dockerfile.gpu on the stand-in base, built from
    the checkout; then the figure for a rebuild after a code change, timed alone."""
    images = session_images
    # A code change: a copy of the context with one handler edited. (Copies, not hard
    # links: the runtime refuses bundle files with more than one link.)
    context = tmp_path_factory.mktemp("context")
    for name in (*CONTEXT, "bundles"):
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, context / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, context / name)
    edited = context / "handlers" / "echo.py"
    text = edited.read_text()
    # A new token each run: the edit is never in the layer cache.
    edited.write_text(
        text + f"\n# edited by tests/deploy to time a rebuild: {secrets.token_hex(8)}\n"
    )
    rebuild_tag = "localhost/thaw-test:rebuild"
    rebuilt = image_script.build(context / "Dockerfile", rebuild_tag, context=context)
    record("rebuild_after_code_change_s", rebuilt.build_s)
    engine("rmi", rebuild_tag, check=False)
    store = subprocess.run(
        ["du", "-sb", "/var/lib/containers/storage"], capture_output=True, text=True, check=False
    )
    if store.returncode == 0:
        record("image_store_bytes", int(store.stdout.split()[0]))
    return images


@pytest.fixture(scope="session")
def built_image(built_images: dict[str, str]) -> str:
    """The Lambda image: the Dockerfile's default target."""
    return built_images["cpu"]


@pytest.fixture(scope="session")
def http_image(built_images: dict[str, str]) -> str:
    """The Dockerfile's `http` target: the same image, as an unprivileged user."""
    return built_images["http"]


def _timed(step: Callable[[], str]) -> dict[str, Any]:
    started = time.monotonic()
    how = step()
    return {"how": how, "s": round(time.monotonic() - started, 1)}


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FIGURES:
        return
    terminalreporter.write_sep("-", "container image figures (tests/deploy)")
    for name, value in FIGURES.items():
        terminalreporter.write_line(f"{name}: {json.dumps(value, default=str)}")
