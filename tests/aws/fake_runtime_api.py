"""A scriptable Lambda Runtime API for testing the loop, on uvicorn in a thread.

The test pushes events and reads back what the runtime posted:

    api.push({"handler": "echo", "input": {}})   -> request id
    api.result(request_id)                        -> Posted(kind="response"|"error", ...)
    api.init_error()                              -> the /init/error post
    api.deliveries                                -> (request_id, time.time()) per `next`
    api.asks                                      -> how many `next` calls arrived
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.support import free_port

PREFIX = "/2018-06-01/runtime"


@dataclass(frozen=True)
class Posted:
    kind: str  # "response" or "error"
    body: bytes
    headers: dict[str, str]
    at: float  # time.time() of the post

    def json(self) -> Any:
        return orjson.loads(self.body)


@dataclass
class FakeRuntimeAPI:
    port: int = field(default_factory=free_port)
    deliveries: list[tuple[str, float]] = field(default_factory=list)
    asks: int = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _queue: asyncio.Queue[tuple[str, bytes, int] | None] | None = None
    _results: dict[str, concurrent.futures.Future[Posted]] = field(default_factory=dict)
    _init: concurrent.futures.Future[Posted] = field(default_factory=concurrent.futures.Future)
    _ready: threading.Event = field(default_factory=threading.Event)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def push(self, event: Any, *, deadline_s: float = 30.0) -> str:
        """Queue an event; the runtime must answer within `deadline_s`."""
        request_id = str(uuid.uuid4())
        self._results[request_id] = concurrent.futures.Future()
        body = event if isinstance(event, bytes) else orjson.dumps(event)
        deadline_ms = int((time.time() + deadline_s) * 1000)
        assert self._loop is not None and self._queue is not None
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (request_id, body, deadline_ms))
        return request_id

    def result(self, request_id: str, timeout_s: float = 30.0) -> Posted:
        return self._results[request_id].result(timeout_s)

    def init_error(self, timeout_s: float = 30.0) -> Posted:
        return self._init.result(timeout_s)

    def gone(self) -> None:
        """Answer the open long-poll for the next event 410 Gone, as `thaw emulate`
        answers a sandbox it stops."""
        assert self._loop is not None and self._queue is not None
        self._loop.call_soon_threadsafe(self._queue.put_nowait, None)

    # -- the server side ------------------------------------------------------

    async def _next(self, request: Request) -> Response:
        assert self._queue is not None
        self.asks += 1
        item = await self._queue.get()
        if item is None:
            return JSONResponse({"errorType": "Stopped"}, status_code=410)
        request_id, body, deadline_ms = item
        self.deliveries.append((request_id, time.time()))
        headers = {
            "Lambda-Runtime-Aws-Request-Id": request_id,
            "Lambda-Runtime-Deadline-Ms": str(deadline_ms),
            "Lambda-Runtime-Invoked-Function-Arn": "arn:aws:lambda:us-east-1:1:function:f",
            "Lambda-Runtime-Trace-Id": "Root=1-00000000-000000000000000000000000",
        }
        return Response(body, headers=headers, media_type="application/json")

    async def _posted(self, request: Request, kind: str) -> Response:
        posted = Posted(kind, await request.body(), dict(request.headers), time.time())
        if kind == "init":
            self._init.set_result(posted)
        else:
            self._results[request.path_params["rid"]].set_result(posted)
        return JSONResponse({"status": "OK"}, status_code=202)

    async def _response(self, request: Request) -> Response:
        return await self._posted(request, "response")

    async def _error(self, request: Request) -> Response:
        return await self._posted(request, "error")

    async def _init_error(self, request: Request) -> Response:
        return await self._posted(request, "init")

    def start(self) -> FakeRuntimeAPI:
        app = Starlette(
            routes=[
                Route(f"{PREFIX}/invocation/next", self._next, methods=["GET"]),
                Route(f"{PREFIX}/invocation/{{rid}}/response", self._response, methods=["POST"]),
                Route(f"{PREFIX}/invocation/{{rid}}/error", self._error, methods=["POST"]),
                Route(f"{PREFIX}/init/error", self._init_error, methods=["POST"]),
            ]
        )
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", timeout_graceful_shutdown=1
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "fake Runtime API did not start"
        return self

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._queue = asyncio.Queue()
            serving = asyncio.ensure_future(self._server.serve())
            while not self._server.started and not serving.done():
                await asyncio.sleep(0.01)
            self._ready.set()
            await serving

        asyncio.run(main())

    def stop(self) -> None:
        if self._loop is not None and self._queue is not None:
            for _ in range(16):  # release any long-poll still open
                self._loop.call_soon_threadsafe(self._queue.put_nowait, None)
        self._server.should_exit = True
        self._thread.join(10)
