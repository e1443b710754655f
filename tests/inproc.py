"""The HTTP contract in-process: the app `create_app` builds, its lifespan run as a
server runs it (startup starts the instance, shutdown drains it), and an
`httpx.AsyncClient` over `httpx.ASGITransport` to it. No process, no socket, no
port: a test of routes, status codes, bodies and headers pays no server start.

httpx 0.28's ASGITransport hands back a response once the app has finished
it, so a test that reads a stream as it arrives (server-sent events followed,
a client that goes away mid-stream) uses `listening()` instead: the same app
on a real uvicorn in this process, on 127.0.0.1 and a port of the kernel's
choosing, reached over a real socket.

Where the process itself is the point (signals, exit codes, drain to exit,
uvicorn's own connection handling), tests keep `tests.support.ServerProcess`.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import uvicorn
from asgi_lifespan import LifespanManager
from starlette.applications import Starlette

from runtime.http.app import create_app
from runtime.instance import Instance
from runtime.settings import Settings
from runtime.telemetry.logs import JSONFormatter
from tests.support import settings_for as settings_for  # the one way tests make settings

BASE_URL = "http://thaw.test"
# Loggers of the test's side of the connection, left out of a captured server log.
CLIENT_LOGGERS = ("httpx", "httpcore")


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    """Run `app`'s ASGI lifespan as a server does: startup before the block, shutdown
    (the instance's drain) after it, however the block ends; a failed startup raises
    the app's own error here. No time limit on either: a start under load, or a
    drain's grace, is not a failure."""
    async with LifespanManager(app, startup_timeout=None, shutdown_timeout=None):
        yield


@dataclass
class Served:
    """An app whose lifespan runs, and a client to it."""

    app: Starlette
    client: httpx.AsyncClient
    transport: httpx.ASGITransport

    def new_client(self, **kwargs: Any) -> httpx.AsyncClient:
        """Another client to the same app (without the first one's headers)."""
        return httpx.AsyncClient(
            transport=self.transport,
            base_url=BASE_URL,
            timeout=kwargs.pop("timeout", 60.0),
            **kwargs,
        )

    @property
    def instance(self) -> Instance:
        instance: Instance = self.app.state.instance
        return instance

    @property
    def settings(self) -> Settings:
        return self.instance.settings


@contextlib.asynccontextmanager
async def serving(
    settings: Settings,
    instance: Instance | None = None,
    *,
    headers: dict[str, str] | None = None,
    timeout_s: float = 60.0,
) -> AsyncIterator[Served]:
    """`create_app(settings, instance)` served in-process until the block ends."""
    app = create_app(settings, instance)
    async with lifespan(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url=BASE_URL, headers=headers, timeout=timeout_s
        ) as client:
            yield Served(app, client, transport)


@dataclass
class Listening:
    """An app on a real uvicorn in this process, on 127.0.0.1."""

    app: Starlette
    url: str

    @property
    def instance(self) -> Instance:
        instance: Instance = self.app.state.instance
        return instance

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=kwargs.pop("timeout", 60.0), **kwargs)


@contextlib.asynccontextmanager
async def listening(
    settings: Settings, instance: Instance | None = None
) -> AsyncIterator[Listening]:
    """`create_app(settings, instance)` on uvicorn in this loop, on a socket bound to
    127.0.0.1 port 0; stopped (lifespan shutdown included) when the block ends."""
    app = create_app(settings, instance)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        lifespan="on",
        log_config=None,
        access_log=False,
        http="h11",
        timeout_keep_alive=5,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        # uvicorn says it listens through `Server.started` only: asked as `thaw serve`
        # asks it (runtime/http/server.py), every millisecond, with no time limit.
        while not server.started and not task.done():
            await asyncio.sleep(0.001)
        if not server.started:
            task.result()
            raise RuntimeError("uvicorn stopped before it listened")
        yield Listening(app, f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        await task
        sock.close()


class LogLines:
    """The runtime's log as a server writes it (JSON lines, runtime.telemetry.logs),
    captured from the root logger while the block runs."""

    def __init__(self) -> None:
        self.stream = io.StringIO()

    @property
    def text(self) -> str:
        return self.stream.getvalue()

    def entries(self) -> list[dict[str, Any]]:
        return [orjson.loads(line) for line in self.text.splitlines() if line.strip()]


@contextlib.contextmanager
def captured_logs(level: int = logging.INFO) -> Iterator[LogLines]:
    """JSON log lines at `level` and above from every logger, for the block."""
    lines = LogLines()
    handler = logging.StreamHandler(lines.stream)
    handler.setFormatter(JSONFormatter())
    handler.setLevel(level)
    # The test's own client logs too: a server's log never held those lines.
    handler.addFilter(lambda record: not record.name.startswith(CLIENT_LOGGERS))
    root = logging.getLogger()
    before = root.level
    root.addHandler(handler)
    root.setLevel(level)
    try:
        yield lines
    finally:
        root.removeHandler(handler)
        root.setLevel(before)


async def until(
    condition: Any,
    what: str,
    *,
    attempts: int = 6000,
    every_s: float = 0.01,
    in_thread: bool = False,
) -> Any:
    """Await `condition()` (a plain or async callable) until it is truthy, and return
    it: a safety limit on the number of looks, not an assertion on time. With
    `in_thread`, a condition that blocks (a database read) is asked in a thread."""
    for _ in range(attempts):
        value = await asyncio.to_thread(condition) if in_thread else condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(every_s)
    raise AssertionError(f"never happened: {what}")


def answer_once(settings: Settings, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """One request to an app started on `settings` and stopped after it: what a
    restarted server answers first, for a sync test (its own event loop)."""
    [response] = answers_once(settings, [(method, path)], **kwargs)
    return response


def answers_once(
    settings: Settings, requests: list[tuple[str, str]], **kwargs: Any
) -> list[httpx.Response]:
    """`answer_once` for several (method, path) requests, in order, to one app."""

    async def ask() -> list[httpx.Response]:
        async with serving(settings) as served:
            return [
                await served.client.request(method, path, **kwargs) for method, path in requests
            ]

    return asyncio.run(ask())
