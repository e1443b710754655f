"""Fixtures for the Lambda loop: a fake Runtime API and real `python -m runtime` processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.aws.fake_runtime_api import FakeRuntimeAPI
from tests.support import make_bundle


class LambdaProcess:
    """`python -m runtime` against a Runtime API; its output in a file."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runtime"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_path.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout_s: float = 20.0) -> int:
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def runtime_api() -> Iterator[FakeRuntimeAPI]:
    api = FakeRuntimeAPI().start()
    yield api
    api.stop()


@pytest.fixture
def tiny_bundles(tmp_path: Path) -> Path:
    """Bundle `tiny` whose builder takes 0.5 s and logs each load to loads.log."""
    root = tmp_path / "bundles"
    make_bundle(root, "tiny", config={"sleep_s": 0.5, "load_log": str(tmp_path / "loads.log")})
    return root


@pytest.fixture
def start_runtime(
    thaw_env: dict[str, str], runtime_api: FakeRuntimeAPI, tmp_path: Path
) -> Iterator[Callable[..., LambdaProcess]]:
    """Start the runtime with extra environment; every process is killed at teardown."""
    started: list[LambdaProcess] = []

    def start(**extra: str) -> LambdaProcess:
        env = {**thaw_env, "AWS_LAMBDA_RUNTIME_API": runtime_api.address, **extra}
        process = LambdaProcess(env, tmp_path / f"runtime-{len(started)}.log")
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()
