"""The app's outer edge (`Edge`): every request's id, its header bound, its
access-log line and duration, and an answer for a request the server's
shutdown cut off.

Every request passes `Edge` first: it gives the request its id, new and
unpredictable for every request (the handler's `ctx.request_id`), keeps a
caller's X-Request-Id apart as its correlation id (answered as X-Request-Id,
and the log context of every line logged while it is served),
adds `Vary: Prefer` where the answer depends on Prefer, and once it is
answered writes its access-log line and its request-duration histogram.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import Awaitable, Iterator
from contextvars import ContextVar
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.clock import SYSTEM, Clock
from runtime.errors import BadRequest, Draining
from runtime.http.problems import problem_response, render_error
from runtime.telemetry.logs import DEFERRED_LOGS, REQUEST_ID
from runtime.telemetry.metrics import UNMATCHED, RequestStats

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# Matches uvicorn's h11_max_incomplete_event_size in server.py.
MAX_HEADER_BYTES = 64 * 1024


def _stopping(scope: Scope) -> bool:
    """True once the server stops (runtime.http.server sets `app.state.stopping`)."""
    app = scope.get("app")
    return bool(getattr(getattr(app, "state", None), "stopping", False))


# The headers the warm path reads, picked out in `Edge`'s one pass: read through
# `header_of`, or straight from `scope[PICKED_SCOPE]` where only the app (whose
# first middleware `Edge` is) calls the reader (the invoke route).
_PICKED = frozenset({b"x-request-id", b"content-length", b"accept", b"prefer"})
PICKED_SCOPE = "thaw.headers"

# Routes whose answer depends on the Prefer header (RFC 7240 §2: `Vary: Prefer`).
_VARY_PREFER = frozenset({"/invoke/{handler}"})
_VARY_PREFER_HEADER = (b"vary", b"Prefer")


class RequestTiming:
    """Where `Edge` records request durations (the instance's metrics, once it
    started), and the clock it times them on (the instance's)."""

    __slots__ = ("clock", "requests")

    def __init__(self, clock: Clock = SYSTEM) -> None:
        self.clock = clock
        self.requests: RequestStats | None = None


class Edge:
    """The app's outer edge: pure ASGI, and one frame for each request's bookkeeping.

    Gives each request its id, a new one drawn from the OS CSPRNG whatever the
    caller sent (`scope["thaw.request_id"]`, the handler's `ctx.request_id`):
    a caller choosing X-Request-Id can neither predict another request's id
    nor make two requests share one. A caller's X-Request-Id that matches
    `_REQUEST_ID` is kept apart as the correlation id
    (`scope["thaw.correlation_id"]`, None without one), and the answer also
    names the request's own id in X-Thaw-Request-Id. The correlation id, else
    the request id, is the log context (runtime.telemetry.logs.REQUEST_ID) of
    every line logged while the request is served, and the X-Request-Id of
    its answer, whatever gives it:
    a route, a problem, a 404 no route matched, a 401 from the auth layer, a
    500 for a bug: every exception a route raises is rendered here, through
    `render_error` (the app has no error middleware of Starlette's:
    runtime/http/routing.py). Answers of routes that read Prefer carry `Vary: Prefer`.
    Once answered, a request adds to the request-duration histogram and writes
    one access-log line (`thaw.access`, info): method, route template (never
    the path's own values, a query or a body), status, duration, request id.

    Refuses a request whose header block exceeds MAX_HEADER_BYTES: uvicorn's
    h11 limit (server.py) bounds only a header block still arriving in pieces;
    one that arrives whole in a single read is parsed however large. This
    bounds both, with a problem+json answer naming the limit. The same pass
    over the headers picks out X-Request-Id.

    Answers a request cut off by the server's shutdown (runtime.http.server
    cancels what still runs when it stops: a long-poll, a body still arriving)
    with 503 `drained`, where the cancellation would otherwise reach uvicorn,
    which answers a text/plain 500 and logs a traceback. Only then: any other
    cancellation (the Lambda loop stopping its workers) goes on as it came.
    """

    def __init__(self, app: ASGIApp, timing: RequestTiming) -> None:
        self.app = app
        self.timing = timing
        # The clock's two readings themselves (plain functions): read on every request.
        self._monotonic = timing.clock.monotonic
        self._wall = timing.clock.wall

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = self._monotonic()
        size = 0
        # The one pass over the headers: the few the warm path reads are kept here
        # (the first of each; every Prefer line), so no later reader scans them again.
        picked: dict[bytes, Any] = {}
        for name, value in scope["headers"]:
            size += len(name) + len(value) + 4
            if name in _PICKED:
                if name == b"prefer":
                    picked.setdefault(name, []).append(value.decode("latin-1"))
                elif name not in picked:
                    picked[name] = value
        scope[PICKED_SCOPE] = picked
        given: bytes | None = picked.get(b"x-request-id")
        # An in-process caller's own unique id (the Lambda loop's invocation id), else new.
        request_id = INVOCATION_ID.get() or next(_IDS)
        scope["thaw.request_id"] = request_id
        # Inline for the common case (no id given): this runs for every request.
        correlation_id = None if given is None else correlation_id_of(given)
        scope["thaw.correlation_id"] = correlation_id
        shown = request_id if correlation_id is None else correlation_id
        id_header = (b"x-request-id", shown.encode())
        # With a correlation id, the request's own id is answered beside it.
        own_header = None if correlation_id is None else (b"x-thaw-request-id", request_id.encode())
        status = 0

        # Not a coroutine function: it hands back the server's own awaitable, so a
        # message costs no coroutine of its own.
        def answer(message: Message) -> Awaitable[None]:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                # A copy: a response object's own header list is left as it was.
                headers = [*message.get("headers", ()), id_header]
                if own_header is not None:
                    headers.append(own_header)
                route = scope.get("route")
                if route is not None and route.path in _VARY_PREFER:
                    headers.append(_VARY_PREFER_HEADER)
                message["headers"] = headers
            return send(message)

        token = REQUEST_ID.set(shown)
        try:
            if size > MAX_HEADER_BYTES:
                exc = BadRequest(
                    f"request headers of {size} bytes exceed the {MAX_HEADER_BYTES}-byte limit",
                    limit_bytes=MAX_HEADER_BYTES,
                )
                await problem_response(exc, scope["path"])(scope, receive, answer)
                return
            try:
                await self.app(scope, receive, answer)
            except asyncio.CancelledError:
                if not _stopping(scope):
                    raise
                cut_off = Draining(
                    "the server shut down before this request finished; send it again"
                )
                # RuntimeError: the response had started already, and the connection
                # closes with it half sent, which is all there is left to do.
                with contextlib.suppress(RuntimeError):
                    await problem_response(cut_off, scope["path"])(scope, receive, answer)
            except Exception as exc:
                if status:
                    raise  # half answered: the server closes the connection
                # render_error logs it; the answer is the 500 problem, with its id.
                response = await render_error(Request(scope, receive), exc)
                await response(scope, receive, answer)
        finally:
            # Answered (or cut off): the request's duration and its access-log line.
            took_s = self._monotonic() - started
            route = scope.get("route")
            template = route.path if route is not None else UNMATCHED
            method: str = scope["method"]
            requests = self.timing.requests
            if requests is not None and status:
                requests.observe(method, template, status, took_s)
            # Written after the answer, with the lines of its window (logs.py), which
            # is where the logger's level is asked (once a window, not per request).
            DEFERRED_LOGS.add(method, template, status, took_s, shown, self._wall())
            REQUEST_ID.reset(token)


# Set by an in-process caller whose request already has an id unique to it and
# given by no client: the Lambda loop, whose invocation ids come from the
# Runtime API (runtime/aws/lambda_loop.py). The app runs in the caller's task.
INVOCATION_ID: ContextVar[str | None] = ContextVar("thaw_invocation_id", default=None)

# Request ids come from the OS CSPRNG, 96 bits each, drawn in blocks so that a
# request costs a slice of a string, not a system call of its own.
_ID_HEX = 24
_IDS_PER_DRAW = 256


def _random_ids() -> Iterator[str]:
    while True:
        block = os.urandom(_IDS_PER_DRAW * _ID_HEX // 2).hex()
        for start in range(0, len(block), _ID_HEX):
            yield block[start : start + _ID_HEX]


_IDS = _random_ids()


def _fresh_ids_after_fork() -> None:
    # A forked child must not hand out the rest of its parent's block.
    global _IDS
    _IDS = _random_ids()


os.register_at_fork(after_in_child=_fresh_ids_after_fork)


def new_request_id() -> str:
    """A new request id: unpredictable, and unique with overwhelming probability."""
    return next(_IDS)


def correlation_id_of(given: bytes) -> str | None:
    """The caller's X-Request-Id when it is a valid one (kept as its correlation id)."""
    text = given.decode("latin-1")
    return text if _REQUEST_ID.fullmatch(text) else None


def request_id_of(request: Request) -> str:
    """The request's own id (given by `Edge`)."""
    request_id: str = request.scope["thaw.request_id"]
    return request_id


def correlation_id_in(request: Request) -> str | None:
    """The caller's X-Request-Id, when it gave a valid one."""
    correlation_id: str | None = request.scope["thaw.correlation_id"]
    return correlation_id


def header_of(request: Request, name: bytes) -> str | None:
    """The request's first `name` header (one of `_PICKED`, lower case), as Starlette's
    `request.headers.get` gives it, from `Edge`'s pass when it ran (else a scan)."""
    picked: dict[bytes, Any] | None = request.scope.get(PICKED_SCOPE)
    if picked is None:
        return request.headers.get(name.decode())
    value: bytes | None = picked.get(name)
    return None if value is None else value.decode("latin-1")
