"""The one place an exception becomes an HTTP answer: application/problem+json.

`render_error` renders every exception a route raises (`Edge` calls it: the
app has no exception handlers of Starlette's, runtime/http/routing.py);
`problem_response` renders a ThawError the runtime raised (the auth layer and
`Edge` call it directly).
The body itself is runtime/wire/render.py's `problem`, shared with every
other surface.
"""

from __future__ import annotations

import logging
import math
from contextvars import ContextVar
from http import HTTPStatus
from types import TracebackType
from typing import Any

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Match, Route

from runtime.errors import (
    BadRequest,
    MethodNotAllowed,
    NotFound,
    Overloaded,
    RequestTimeout,
    ThawError,
)
from runtime.wire.render import http_headers, problem

log = logging.getLogger("thaw.app")

PROBLEM = "application/problem+json"

# Errors answered before the request body was read to its end.
_CLOSES_CONNECTION = (RequestTimeout, Overloaded)


def problem_response(exc: ThawError, request_path: str | None = None) -> Response:
    """`exc` as application/problem+json (runtime/wire/render.py), `request_path` its `instance`;
    under /v1/ (the OpenAI routes), as OpenAI's error body instead (`openai_error`)."""
    headers = http_headers(exc)
    # A problem echoes what it was sent (a path, a handler's message): never sniffed as HTML.
    headers["X-Content-Type-Options"] = "nosniff"
    if isinstance(exc, _CLOSES_CONNECTION):
        # The rest of the body is never read: the connection cannot carry another request.
        headers["Connection"] = "close"
    if request_path is not None and request_path.startswith(OPENAI_PREFIX):
        if exc.retry_after_s is not None:
            # The official clients read this one first, to the millisecond.
            headers["retry-after-ms"] = str(max(1, math.ceil(exc.retry_after_s * 1000)))
        return Response(
            orjson.dumps(openai_error(exc), default=str),
            status_code=exc.status,
            headers=headers,
            media_type="application/json",
        )
    return Response(
        orjson.dumps(problem(exc, request_path), default=str),
        status_code=exc.status,
        headers=headers,
        media_type=PROBLEM,
    )


# The routes whose errors are OpenAI's error body (runtime/http/routes/openai.py).
OPENAI_PREFIX = "/v1/"
# OpenAI's error `type` by status; its clients pick the exception class by status alone.
_OPENAI_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    429: "rate_limit_error",
}
# Codes OpenAI's own API uses where Thaw has the same error; else the slug, snake_case.
_OPENAI_CODES = {"unknown-handler": "model_not_found", "unauthorized": "invalid_api_key"}


def openai_error(exc: ThawError) -> dict[str, Any]:
    """`exc` as OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    if exc.status >= 500:
        kind = "server_error"
    else:
        kind = _OPENAI_TYPES.get(exc.status, "invalid_request_error")
    code = exc.extra.get("code") or _OPENAI_CODES.get(exc.slug, exc.slug.replace("-", "_"))
    param = exc.extra.get("field")
    return {"error": {"message": exc.message, "type": kind, "param": param, "code": code}}


class _StatusOnly(ThawError):
    """A Starlette HTTPException of a status the tree has no class for."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status  # type: ignore[misc]
        self.title = HTTPStatus(status).phrase  # type: ignore[misc]


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path (several routes may share one)."""
    methods: set[str] = set()
    for route in request.app.routes:
        if isinstance(route, Route) and route.matches(request.scope)[0] is not Match.NONE:
            methods |= route.methods or set()
    return sorted(methods)


# Set by an in-process caller that renders errors for a surface of its own (the
# Lambda loop, runtime/aws/lambda_loop.py): `render_error` appends each error
# it answers to the list, the exception itself and its traceback (Starlette
# clears `__traceback__` once the answer is sent), so that its cause and
# frames reach the caller and nothing is parsed back out of a problem+json
# body. A list in a ContextVar: the app runs in the caller's task, and a task
# it might start would see the same list.
ErrorSink = list[tuple[BaseException, TracebackType | None]]
ERROR_SINK: ContextVar[ErrorSink | None] = ContextVar("thaw_error_sink", default=None)


def _as_thaw_error(request: Request, exc: Exception) -> ThawError:
    """`exc` as the ThawError its answer renders; an unexpected one is logged."""
    if isinstance(exc, ThawError):
        return exc
    if isinstance(exc, HTTPException):
        # Starlette's own routing errors (404 no route, 405 wrong method).
        if exc.status_code == 404:
            return NotFound(f"no route for {request.method} {request.url.path}")
        if exc.status_code == 405:
            allow = _allowed_methods(request)
            return MethodNotAllowed(
                f"{request.method} is not allowed on {request.url.path}; "
                f"allowed: {', '.join(allow)}",
                allow=allow,
            )
        return _StatusOnly(exc.status_code, exc.detail or "error")
    if isinstance(exc, ClientDisconnect):
        # The client's own doing, not a fault here: no traceback, and nobody to answer.
        log.info(
            "client disconnected before its request body arrived: %s %s",
            request.method,
            request.url.path,
        )
        return BadRequest("client disconnected")
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return ThawError("internal error; see the server log")


async def render_error(request: Request, exc: Exception) -> Response:
    """The one place errors become HTTP responses."""
    error = _as_thaw_error(request, exc)
    sink = ERROR_SINK.get()
    if sink is not None:
        # A fault of the runtime (rendered as the bare root class) goes as raised:
        # the sink's surface names it.
        raised = exc if type(error) is ThawError else error
        sink.append((raised, raised.__traceback__))
    return problem_response(error, request.url.path)
