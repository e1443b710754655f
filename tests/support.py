"""Helpers shared by the tests: bundles on disk, free ports, a real server process,
an instance in-process."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

from runtime.bundles.manifest import Manifest, build_bundle
from runtime.instance import Instance
from runtime.settings import Settings


def make_bundle(
    root: Path,
    name: str,
    *,
    shards: int = 1,
    floats_per_shard: int = 256,
    config: dict[str, Any] | None = None,
    per_request_bytes: int = 0,
    weights_bytes: int | None = None,
    seed: int = 0,
    thaw: dict[str, Any] | None = None,
) -> Manifest:
    """Write a real safetensors bundle `root/name` and return its manifest."""
    import torch
    from safetensors.torch import save_file

    src = root / f".src-{name}"
    src.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    for index in range(shards):
        save_file(
            {f"layer{index}.weight": torch.randn(floats_per_shard, generator=generator)},
            src / f"model-{index:05d}.safetensors",
        )
    manifest = build_bundle(
        src,
        name,
        out=root / name,
        config=config or {},
        per_request_bytes=per_request_bytes,
        weights_bytes=weights_bytes,
        thaw=thaw,
    )
    for path in src.iterdir():
        path.unlink()
    src.rmdir()
    return manifest


def settings_for(root: Path, **overrides: Any) -> Settings:
    """The one way a test makes an in-process instance's settings: every piece of
    state under `root` (bundles from `root/bundles` unless overridden), `overrides`
    on top, validated as the environment's are; never read from os.environ. (A
    process under test reads its own: `thaw_env`, tests/conftest.py.)"""
    values: dict[str, Any] = {
        "cache_dir": str(root / "cache"),
        "state_dir": str(root / "state"),
        "job_store": f"sqlite:///{root / 'jobs.sqlite3'}",
        "bundle_source": str(root / "bundles"),
    }
    values.update(overrides)
    settings = Settings(**values)
    settings.validate()
    return settings


# How long a test waits for a real thread, process or server to do what it
# must before calling it hung: a safety limit against hangs, far past anything
# a loaded 2-core machine needs, never an assertion on how fast it happens.
SAFETY_S = 120.0


def until(condition: Callable[[], Any], what: str, timeout_s: float = SAFETY_S) -> Any:
    """Poll `condition` until truthy and return its value (a safety limit, not an
    assertion on time)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


class ReadOnlyFs:
    """A tmpfs mounted at `path` and sealed read-only: its superblock's flag, so read-only
    for every mount of it, as a Lambda function's image is. `writable()` lifts the seal
    for a block (to change what a running model must no longer see). Needs the right
    to mount (root, in CI); `available()` says whether this process has it."""

    def __init__(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        _mount("-t", "tmpfs", "-o", "size=512m,mode=0755", "tmpfs", str(path))

    @staticmethod
    @functools.cache
    def available() -> bool:
        """Whether this process may mount (root is not enough in a container without
        CAP_SYS_ADMIN): tried once, on a scratch directory."""
        if sys.platform != "linux" or os.geteuid() != 0:
            return False
        with tempfile.TemporaryDirectory(prefix="thaw-mount-probe-") as scratch:
            tried = subprocess.run(["mount", "-t", "tmpfs", "tmpfs", scratch], capture_output=True)
            if tried.returncode:
                return False
            subprocess.run(["umount", scratch], check=True)
            return True

    def seal(self) -> None:
        _mount("-o", "remount,ro", str(self.path))

    @contextlib.contextmanager
    def writable(self) -> Iterator[Path]:
        _mount("-o", "remount,rw", str(self.path))
        try:
            yield self.path
        finally:
            self.seal()

    def close(self) -> None:
        if subprocess.run(["umount", str(self.path)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(self.path)], check=True)


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ServerProcess:
    """A real `thaw serve` process on 127.0.0.1; always stopped by its user."""

    def __init__(
        self, env: Mapping[str, str], *, port: int | None = None, cwd: Path | None = None
    ) -> None:
        self.port = port or free_port()
        self.cwd = cwd  # a user's project, whose `handlers/` is found first
        self.env = dict(env)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.log_path = Path(self.env.get("THAW_STATE_DIR", "/tmp")) / f"server-{self.port}.log"

    def start(self, *, wait: bool = True) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.cli.main", "serve", "--port", str(self.port)],
            env=self.env,
            cwd=self.cwd,
            stdout=open(self.log_path, "ab"),  # noqa: SIM115 - closed with the process
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if wait:
            self.wait_healthy()
        return self

    def wait_healthy(self, timeout_s: float = 20.0) -> float:
        """Seconds from process start to the first 200 from /healthz."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=0.5).status_code == 200:
                    return time.monotonic() - self.started_at
            except httpx.TransportError:
                pass
            time.sleep(0.01)
        raise RuntimeError(f"server not healthy after {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 30.0), **kwargs)

    def terminate(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, wait, then SIGKILL the process group; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def maps(self) -> str:
        assert self.proc is not None
        return Path(f"/proc/{self.proc.pid}/maps").read_text()

    def __enter__(self) -> ServerProcess:
        # `with ServerProcess(env).start() as server` started it already: a second
        # start would leave the first process running, unstopped.
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()


@contextlib.asynccontextmanager
async def running_instance(settings: Settings) -> AsyncIterator[Instance]:
    """An instance started in-process, stopped however the block ends."""
    instance = Instance.create(settings)
    await instance.start()
    try:
        yield instance
    finally:
        await instance.stop()
