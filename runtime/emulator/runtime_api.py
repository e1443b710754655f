"""The platform side of the Lambda Runtime API: one listener per sandbox.

Each sandbox gets its own listener on 127.0.0.1 and a plain `host:port` in
AWS_LAMBDA_RUNTIME_API, as on Lambda, so any Runtime API client works against
it: clients that build URLs with a URL parser or hand the address to an HTTP
connection (awslambdaric's `http.client.HTTPConnection(address)`) refuse an
address with a path in it. The listener knows its sandbox; no id travels in
the URL. A container sandbox on the host network reaches it the same way.

    GET  /2018-06-01/runtime/invocation/next
    POST /2018-06-01/runtime/invocation/{rid}/response
    POST /2018-06-01/runtime/invocation/{rid}/error
    POST /2018-06-01/runtime/init/error

A buffered response over Lambda's limit (runtime/aws/limits.py) is refused
with Lambda's 413, and the caller answered Function.ResponseSizeTooLarge.
A response posted with `Lambda-Runtime-Function-Response-Mode: streaming`
is handed on chunk by chunk, its error trailers read at its end
(runtime/emulator/streaming.py).

A listener is a small h11 server (http11.py) in the emulator's event loop: it
keeps a streamed response's trailers and leaves the signal handlers to the
emulator's own server. It serves a `Platform` (the pool) and imports nothing
else of the emulator's but its server and the streaming leaf (and Lambda's
limits, from runtime/aws/limits.py).
"""

from __future__ import annotations

import socket
from typing import Protocol

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from runtime.aws import limits
from runtime.emulator import http11, streaming
from runtime.emulator.streaming import ResponseChunks

PREFIX = "/2018-06-01/runtime"
ERROR_TYPE_HEADER = "lambda-runtime-function-error-type"
LISTEN_HOST = "127.0.0.1"
_ACCEPTED = {"status": "OK"}


class Delivery(Protocol):
    """An event handed to a runtime by `next`."""

    request_id: str
    payload: bytes
    deadline_ms: int
    function_arn: str
    trace_id: str
    client_context: str | None


class Platform(Protocol):
    """What the Runtime API asks of the emulator (the pool), for one sandbox at a time."""

    async def next(self, sid: str) -> Delivery | None: ...

    async def complete(
        self,
        sid: str,
        request_id: str,
        payload: bytes,
        error_type: str | None,
        stream: ResponseChunks | None = None,
    ) -> bool: ...

    def init_failed(self, sid: str, error_type: str, payload: bytes) -> None: ...


def _pool(request: Request) -> Platform:
    pool: Platform = request.app.state.pool
    return pool


def _sid(request: Request) -> str:
    sid: str = request.app.state.sid
    return sid


def _error_type(request: Request, body: bytes) -> str:
    """The error type: from the body's errorType, else the header, else Unhandled."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        payload = None
    if isinstance(payload, dict) and isinstance(payload.get("errorType"), str):
        return str(payload["errorType"])
    return request.headers.get(ERROR_TYPE_HEADER) or "Unhandled"


async def next_invocation(request: Request) -> Response:
    invocation = await _pool(request).next(_sid(request))
    if invocation is None:
        # The sandbox is being stopped; it is signalled as well.
        return JSONResponse({"errorType": "Runtime.Stopping"}, status_code=410)
    headers = {
        "Lambda-Runtime-Aws-Request-Id": invocation.request_id,
        "Lambda-Runtime-Deadline-Ms": str(invocation.deadline_ms),
        "Lambda-Runtime-Invoked-Function-Arn": invocation.function_arn,
        "Lambda-Runtime-Trace-Id": invocation.trace_id,
    }
    if invocation.client_context:
        headers["Lambda-Runtime-Client-Context"] = invocation.client_context
    return Response(invocation.payload, headers=headers, media_type="application/json")


async def invocation_response(request: Request) -> Response:
    if streaming.is_streaming(request):
        sink = ResponseChunks(request.headers.get("content-type", "application/octet-stream"))
        rid = request.path_params["rid"]
        if not await _pool(request).complete(_sid(request), rid, b"", None, sink):
            return _answer(False)
        await streaming.receive(request, sink)
        return _answer(True)
    body = await request.body()
    rid = request.path_params["rid"]
    if len(body) > limits.MAX_RESPONSE_BYTES:
        # As Lambda: the runtime is told 413, the caller gets Function.ResponseSizeTooLarge.
        error = orjson.dumps(
            {
                "errorMessage": limits.response_message(len(body)),
                "errorType": limits.RESPONSE_TOO_LARGE,
            }
        )
        if not await _pool(request).complete(_sid(request), rid, error, limits.RESPONSE_TOO_LARGE):
            return _answer(False)
        refused = {
            "errorMessage": limits.runtime_api_message(),
            "errorType": limits.RUNTIME_API_TOO_LARGE,
        }
        return JSONResponse(refused, status_code=413)
    done = await _pool(request).complete(_sid(request), rid, body, None)
    return _answer(done)


async def invocation_error(request: Request) -> Response:
    body = await request.body()
    done = await _pool(request).complete(
        _sid(request), request.path_params["rid"], body, _error_type(request, body)
    )
    return _answer(done)


async def init_error(request: Request) -> Response:
    body = await request.body()
    _pool(request).init_failed(_sid(request), _error_type(request, body), body)
    return JSONResponse(_ACCEPTED, status_code=202)


def _answer(done: bool) -> Response:
    if done:
        return JSONResponse(_ACCEPTED, status_code=202)
    # As Lambda: the invocation already ended (timed out) or never existed.
    return JSONResponse(
        {"errorMessage": "Invalid request ID", "errorType": "InvalidRequestID"}, status_code=400
    )


routes = [
    Route(f"{PREFIX}/invocation/next", next_invocation, methods=["GET"]),
    Route(f"{PREFIX}/invocation/{{rid}}/response", invocation_response, methods=["POST"]),
    Route(f"{PREFIX}/invocation/{{rid}}/error", invocation_error, methods=["POST"]),
    Route(f"{PREFIX}/init/error", init_error, methods=["POST"]),
]


class RuntimeListener:
    """One sandbox's Runtime API on 127.0.0.1 and a port of its own."""

    def __init__(self, pool: Platform, sid: str) -> None:
        app = Starlette(routes=routes)
        app.state.pool, app.state.sid = pool, sid
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that say
        # so, and without it every response waits ~40 ms on a delayed ACK.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((LISTEN_HOST, 0))
        self.address = f"{LISTEN_HOST}:{self._sock.getsockname()[1]}"
        self._server = http11.Server(app)

    async def start(self) -> None:
        await self._server.start(self._sock)

    def stop(self) -> None:
        """Stop listening; connections still open are closed within a second."""
        self._server.close()

    async def wait_closed(self) -> None:
        await self._server.wait_closed(grace_s=1.0)
        self._sock.close()
