"""One `thaw serve` process for bench/gpu.py, and what the check asks of it over HTTP.

The server is a real process (bench/common.py's `Proc`) with the given handler
modules and device; it is always stopped on the way out of `async with`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import orjson

from bench.common import Conn, Proc, free_port, request, runtime_env, thaw_serve_argv

LOAD_TIMEOUT_S = 300.0
POLL_S = 0.01


def load_average() -> float:
    return os.getloadavg()[0]


def driver_used_bytes(pid: int) -> int | None:
    """Device memory the driver accounts to process `pid` (nvidia-smi), or None where
    nvidia-smi is absent or does not list it (no device; another PID namespace)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    query = ["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    done = subprocess.run([exe, *query], capture_output=True, text=True, timeout=60)
    for line in done.stdout.splitlines() if done.returncode == 0 else []:
        found, _, used_mib = line.partition(",")
        if found.strip() == str(pid):
            return int(used_mib.strip()) * 1024 * 1024
    return None


@dataclass
class Loop:
    """A closed loop's outcome: each client sent its next request when its answer came."""

    seconds: float
    latencies: list[float] = field(default_factory=list)
    completion_tokens: int = 0

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.seconds

    @property
    def tokens_rate(self) -> float:
        return self.completion_tokens / self.seconds


class Server:
    """`thaw serve` on a free port, serving `modules` from `source` on `device`; its
    log is `node/{name}.log`."""

    def __init__(self, node: Path, name: str, source: Path, modules: str, device: str) -> None:
        self.device = device
        self.port = free_port()
        # One node for every server of a run, one after another (as restarts on one
        # machine): its cache and stamps spare each later start the files' hashing.
        env = runtime_env(
            node,
            HANDLERS=modules,
            BUNDLE_SOURCE=str(source),
            DEVICE=device,
            # Every answer is awaited: the largest requests must not become jobs.
            WAIT_S="600",
            MAX_WAIT_S="600",
        )
        self.proc = Proc(thaw_serve_argv(self.port), env, self.port, node / f"{name}.log")

    async def __aenter__(self) -> Server:
        self.proc.start()
        await asyncio.to_thread(self.proc.wait_healthy, 120.0)
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.to_thread(self.proc.stop)

    @property
    def pid(self) -> int:
        assert self.proc.proc is not None
        return self.proc.proc.pid

    async def driver_used(self) -> int | None:
        """What nvidia-smi says this server holds on the device (None: it cannot say)."""
        return await asyncio.to_thread(driver_used_bytes, self.pid)

    def _fail(self, what: str) -> RuntimeError:
        return RuntimeError(f"{what}\n--- server log ---\n{self.proc.log()}")

    async def invoke(self, handler: str, event: Any) -> tuple[float, Any]:
        """(seconds from before the connect to the last byte, output) of one invocation."""
        reply = await request(self.port, "POST", f"/invoke/{handler}", orjson.dumps(event))
        if reply.status != 200:
            raise self._fail(f"{handler}: {reply.status} {reply.body[:500]!r}")
        return reply.wall_s, orjson.loads(reply.body)

    async def view(self, bundle: str) -> dict[str, Any]:
        reply = await request(self.port, "GET", "/models")
        models = orjson.loads(reply.body)["models"]
        found: dict[str, Any] = next(m for m in models if m["name"] == bundle)
        return found

    async def load(self, bundle: str) -> dict[str, Any]:
        """Ask for a load (`POST /models/{bundle}/load`) and wait until it is READY."""
        reply = await request(self.port, "POST", f"/models/{bundle}/load")
        if reply.status != 202:
            raise self._fail(f"load {bundle}: {reply.status} {reply.body[:500]!r}")
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while time.monotonic() < deadline:
            view = await self.view(bundle)
            if view["state"] == "ready":
                return view
            if view["state"] == "failed":
                raise self._fail(f"load {bundle} failed: {view['error']}")
            await asyncio.sleep(POLL_S)
        raise self._fail(f"{bundle} not ready after {LOAD_TIMEOUT_S} s")

    async def unload(self, bundle: str) -> None:
        """`DELETE /models/{bundle}`: answers once the memory was released."""
        reply = await request(self.port, "DELETE", f"/models/{bundle}")
        if reply.status != 200:
            raise self._fail(f"unload {bundle}: {reply.status} {reply.body[:500]!r}")

    async def memory(self, *, reset_peak: bool = False) -> dict[str, Any]:
        """The server process's device memory (bench/gpu_probe.py), in bytes."""
        event = {"device": self.device, "reset_peak": reset_peak}
        figures: dict[str, Any] = (await self.invoke("device_memory", event))[1]
        return figures

    async def closed_loop(self, handler: str, event: Any, clients: int, each: int) -> Loop:
        """`clients` keep-alive connections, `each` requests apiece, back to back."""
        body = orjson.dumps(event)
        conns = [await Conn(self.port).open() for _ in range(clients)]
        loop = Loop(0.0)

        async def client(conn: Conn) -> None:
            for _ in range(each):
                reply = await conn.request("POST", f"/invoke/{handler}", body)
                if reply.status != 200:
                    raise self._fail(f"{handler}: {reply.status} {reply.body[:500]!r}")
                loop.latencies.append(reply.wall_s)
                usage = orjson.loads(reply.body).get("usage") if handler == "generate" else None
                if usage:
                    loop.completion_tokens += int(usage["completion_tokens"])

        started = time.perf_counter()
        try:
            await asyncio.gather(*(client(c) for c in conns))
        finally:
            loop.seconds = time.perf_counter() - started
            for conn in conns:
                await conn.close()
        return loop
