"""The HTTP contract as a Starlette app. Endpoints are module-level functions;
errors are rendered in one place (`render_error`) as application/problem+json.

Every request passes `Edge` first: it gives the request its id (answered as
X-Request-Id, and the log context of every line logged while it is served),
adds `Vary: Prefer` where the answer depends on Prefer, and once it is
answered writes its access-log line and its request-duration histogram.

Request bodies are read by `Intake` (one per app): each must arrive whole
within THAW_BODY_TIMEOUT_S (408 and the connection closed), and the bytes
held by bodies across every connection stay under THAW_MAX_BUFFERED_BYTES
(503 `overloaded` past it), so slow or stalled clients cannot hold the
server's memory or its connections forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable
from contextvars import ContextVar
from http import HTTPStatus
from types import TracebackType
from typing import Any
from urllib.parse import quote

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.dispatch.dispatcher import Accepted, Completed
from runtime.dispatch.streams import Streaming
from runtime.errors import (
    BadRequest,
    Draining,
    InvalidJSON,
    MethodNotAllowed,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    ThawError,
    UnknownBundle,
)
from runtime.http import sse
from runtime.http.auth import AuthMiddleware, KeyRing
from runtime.http.prefer import NO_PREFERENCES, parse_prefer
from runtime.instance import Instance
from runtime.jobs.job import Job
from runtime.settings import Settings
from runtime.telemetry.logs import REQUEST_ID
from runtime.telemetry.metrics import UNMATCHED, RequestStats
from runtime.wire.outputs import encode_output
from runtime.wire.render import http_headers, problem

log = logging.getLogger("thaw.app")
# One line per request, at info: method, route template, status, duration, request id.
access_log = logging.getLogger("thaw.access")

PROBLEM = "application/problem+json"
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_JSON_OPTS = orjson.OPT_SERIALIZE_NUMPY
# Matches uvicorn's h11_max_incomplete_event_size in server.py.
MAX_HEADER_BYTES = 64 * 1024


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=_JSON_OPTS)


# Errors answered before the request body was read to its end.
_CLOSES_CONNECTION = (RequestTimeout, Overloaded)


def problem_response(exc: ThawError, request_path: str | None = None) -> Response:
    """`exc` as application/problem+json (runtime/wire/render.py), `request_path` its `instance`."""
    headers = http_headers(exc)
    if isinstance(exc, _CLOSES_CONNECTION):
        # The rest of the body is never read: the connection cannot carry another request.
        headers["Connection"] = "close"
    return Response(
        orjson.dumps(problem(exc, request_path), default=str),
        status_code=exc.status,
        headers=headers,
        media_type=PROBLEM,
    )


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


def _stopping(scope: Scope) -> bool:
    """True once the server stops (runtime.http.server sets `app.state.stopping`)."""
    app = scope.get("app")
    return bool(getattr(getattr(app, "state", None), "stopping", False))


# Routes whose answer depends on the Prefer header (RFC 7240 §2: `Vary: Prefer`).
_VARY_PREFER = frozenset({"/invoke/{handler}"})
_VARY_PREFER_HEADER = (b"vary", b"Prefer")


class Observed:
    """Where `Edge` records request durations: the instance's metrics, once it started."""

    __slots__ = ("requests",)

    def __init__(self) -> None:
        self.requests: RequestStats | None = None


class Edge:
    """The app's outer edge: pure ASGI, and one frame for each request's bookkeeping.

    Gives each request its id: the caller's X-Request-Id when it matches
    `_REQUEST_ID`, else a new one. The id is `scope["thaw.request_id"]`, the
    log context (runtime.telemetry.logs.REQUEST_ID) of every line logged while the
    request is served, and the X-Request-Id of its answer, whatever gives it:
    a route, a problem, a 404 no route matched, a 401 from the auth layer, a
    500 for a bug (`render_error` is called here for an exception no handler
    answered, which Starlette's outermost middleware would otherwise answer
    past this edge). Answers of routes that read Prefer carry `Vary: Prefer`.
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

    def __init__(self, app: ASGIApp, observed: Observed) -> None:
        self.app = app
        self.observed = observed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        size = 0
        given: bytes | None = None
        for name, value in scope["headers"]:
            size += len(name) + len(value) + 4
            if name == b"x-request-id" and given is None:
                given = value
        # Inline for the common case (no id given): this runs for every request.
        request_id = (
            f"{_ID_PREFIX}-{next(_ID_COUNTER):x}" if given is None else new_request_id(given)
        )
        scope["thaw.request_id"] = request_id
        id_header = (b"x-request-id", request_id.encode())
        status = 0

        # Not a coroutine function: it hands back the server's own awaitable, so a
        # message costs no coroutine of its own.
        def answer(message: Message) -> Awaitable[None]:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                # A copy: a response object's own header list is left as it was.
                headers = [*message.get("headers", ()), id_header]
                route = scope.get("route")
                if route is not None and route.path in _VARY_PREFER:
                    headers.append(_VARY_PREFER_HEADER)
                message["headers"] = headers
            return send(message)

        token = REQUEST_ID.set(request_id)
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
            took_s = time.monotonic() - started
            route = scope.get("route")
            template = route.path if route is not None else UNMATCHED
            method: str = scope["method"]
            requests = self.observed.requests
            if requests is not None and status:
                requests.observe(method, template, status, took_s)
            if access_log.isEnabledFor(logging.INFO):
                _access_line(method, template, status, took_s)
            REQUEST_ID.reset(token)


def _access_line(method: str, template: str, status: int, took_s: float) -> None:
    """One request's access-log line (status 0: it ended with no answer, cut off)."""
    took_ms = round(took_s * 1000, 3)
    access_log.info(
        "%s %s %d %.1f ms",
        method[:16],
        template,
        status,
        took_ms,
        extra={
            "method": method[:16],
            "route": template,
            "status_code": status,
            "duration_ms": took_ms,
        },
    )


def _instance(request: Request) -> Instance:
    instance: Instance = request.app.state.instance
    return instance


# A random prefix per process and a counter: unique ids without drawing random
# bytes on every request (request ids label logs; they are not secrets).
_ID_PREFIX = secrets.token_hex(6)
_ID_COUNTER = itertools.count(1)


def new_request_id(given: bytes | None) -> str:
    """The caller's X-Request-Id when it is a valid one, else a new id."""
    if given is not None:
        text = given.decode("latin-1")
        if _REQUEST_ID.fullmatch(text):
            return text
    return f"{_ID_PREFIX}-{next(_ID_COUNTER):x}"


def request_id_of(request: Request) -> str:
    """The request's id (given by `Edge`)."""
    request_id: str = request.scope["thaw.request_id"]
    return request_id


def key_id_of(request: Request) -> str | None:
    """The caller's API key id (set by the auth middleware), None when auth is off."""
    return request.scope.get("thaw.key_id")


def _too_deep(body: bytes, value: Any, max_depth: int) -> bool:
    """True when `value` nests arrays/objects more than `max_depth` levels deep.

    Iterative, so a deep document cannot exhaust the stack. A body with no more
    brackets than the limit cannot be too deep: that C-speed count keeps the
    walk off the warm path of ordinary (wide, shallow) events.
    """
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if depth > max_depth:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


class Intake:
    """Request bodies being read, across every connection of one app.

    Each body must arrive whole within `timeout_s` (THAW_BODY_TIMEOUT_S) of
    the start of its read, or its request is answered 408 and its connection
    closed: a client trickling bytes, or one whose body stops short of its
    Content-Length, holds a connection and its buffer for that long at most.
    The bytes bodies hold stay under `limit` (THAW_MAX_BUFFERED_BYTES): a body
    whose next chunk would pass it is answered 503 `overloaded`. A request's
    bytes are counted as they arrive and given back (`release`) when it is done.
    Bodies still arriving may not take the last `reserve` bytes (64 KiB, or a
    quarter of a smaller cap): clients that stall mid-body fill the cap only so
    far, and a request whose body arrives whole is still served beside them.

    One loop timer serves every read (as runtime/dispatch/deadlines.py does for
    waiting requests): a read costs two dict operations, not a timer of its
    own. A read past its deadline has its task cancelled, and turns that
    cancellation into RequestTimeout.
    """

    def __init__(self, limit: int, timeout_s: float) -> None:
        self.limit = limit
        self.reserve = min(64 * 1024, limit // 4)
        self.timeout_s = timeout_s
        self.buffered = 0
        self._reading: dict[asyncio.Task[Any], float] = {}
        self._late: set[asyncio.Task[Any]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    async def read(self, request: Request, max_body_bytes: int) -> bytes:
        """The whole body, counted in `buffered` until `release(len(body))`."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise PayloadTooLarge(
                f"body of {declared} bytes exceeds THAW_MAX_BODY_BYTES={max_body_bytes}",
                limit_bytes=max_body_bytes,
            )
        task = asyncio.current_task()
        if task is not None:
            # The default loop's clock is time.monotonic(); inline, as this runs per request.
            deadline = time.monotonic() + self.timeout_s
            self._reading[task] = deadline
            # With one timeout for all, deadlines only grow: the timer rarely moves.
            if self._timer is None or deadline < self._timer_at:
                self._arm(deadline)
        receive = request.receive
        chunks: list[bytes] = []
        size = 0
        try:
            try:
                while True:
                    message = await receive()
                    if message["type"] != "http.request":  # http.disconnect
                        raise ClientDisconnect()
                    chunk: bytes = message.get("body", b"")
                    more: bool = message.get("more_body", False)
                    if chunk:
                        if size + len(chunk) > max_body_bytes:
                            raise PayloadTooLarge(
                                f"body exceeds THAW_MAX_BODY_BYTES={max_body_bytes}",
                                limit_bytes=max_body_bytes,
                            )
                        # Whole at once, or still arriving (kept out of the reserve).
                        room = self.limit - self.reserve if more or size else self.limit
                        if self.buffered + len(chunk) > room:
                            raise self._overloaded(len(chunk), room)
                        self.buffered += len(chunk)
                        size += len(chunk)
                        chunks.append(chunk)
                    if not more:
                        break
            except asyncio.CancelledError:
                if task is not None and task in self._late and task.uncancel() == 0:
                    raise RequestTimeout(
                        f"the request body did not arrive within THAW_BODY_TIMEOUT_S="
                        f"{self.timeout_s:g} s ({size} bytes received)",
                        timeout_s=self.timeout_s,
                    ) from None
                raise
        except BaseException:
            self.buffered -= size
            raise
        finally:
            if task is not None:
                del self._reading[task]
                if self._late:
                    self._late.discard(task)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def release(self, size: int) -> None:
        """Give back the bytes of a body `read` returned: its request is done."""
        self.buffered -= size

    def _overloaded(self, size: int, room: int) -> Overloaded:
        kept = "" if room == self.limit else f" less {self.reserve} kept for whole bodies"
        # Bytes come back as requests finish; a body still arriving holds its
        # bytes THAW_BODY_TIMEOUT_S at most.
        return Overloaded(
            f"{self.buffered} bytes of request bodies are buffered; {size} more would pass "
            f"THAW_MAX_BUFFERED_BYTES={self.limit}{kept}",
            limit_bytes=self.limit,
            retry_after_s=1.0,
        )

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_at(at, self._fire)
        self._timer_at = at

    def _fire(self) -> None:
        self._timer = None
        now = time.monotonic()
        earliest: float | None = None
        for task, at in self._reading.items():
            if task in self._late:
                continue
            if at <= now:
                self._late.add(task)
                task.cancel()
            elif earliest is None or at < earliest:
                earliest = at
        if earliest is not None:
            self._arm(earliest)


def parse_json(body: bytes, max_depth: int = 64) -> Any:
    """`body` as JSON (empty is `{}`), refusing documents nested deeper than `max_depth`."""
    if not body.strip():
        return {}
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidJSON(f"body is not valid JSON: {exc}") from exc
    if isinstance(value, (dict, list)) and _too_deep(body, value, max_depth):
        raise BadRequest(
            f"JSON nesting exceeds THAW_MAX_JSON_DEPTH={max_depth}", max_json_depth=max_depth
        )
    return value


# Values that hold no number to check (bool is an int).
def server_timing(timings_ms: dict[str, float], batch_size: int | None = None) -> str:
    """The Server-Timing value; the dispatcher fills `timings_ms` in phase order.
    A batched request's `batch` (its wait for the batch) says the batch's size."""
    return ", ".join(
        [
            f'{name};dur={ms:.3f};desc="n={batch_size}"'
            if name == "batch" and batch_size is not None
            else f"{name};dur={ms:.3f}"
            for name, ms in timings_ms.items()
        ]
    )


def job_response(
    job: Job,
    status: int = 200,
    retry_after_s: float | None = None,
    *,
    applied: str | None = None,
) -> Response:
    headers = {"Location": f"/jobs/{job.id}"}
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    if applied is not None:
        # RFC 7240: only preferences the client sent and the server honoured.
        headers["Preference-Applied"] = applied
    return JSONResponse(job.public(), status_code=status, headers=headers)


def _refused(instance: Instance, name: str, exc: ThawError) -> None:
    """Count a request to a known handler that was refused before it was admitted."""
    stats = instance.metrics.handlers.get(name)  # never a new label for an unknown name
    if stats is not None:
        stats.count("client_error" if exc.status < 500 else "error")


async def _invoke(request: Request, *, force_async: bool) -> Response | sse.EventStreamResponse:
    state = request.app.state
    instance: Instance = state.instance
    intake: Intake = state.intake
    settings = instance.settings
    name = request.path_params["handler"]
    size = 0
    try:  # the body's bytes count against THAW_MAX_BUFFERED_BYTES until the answer
        try:
            raw = await intake.read(request, settings.max_body_bytes)
            size = len(raw)
            event = parse_json(raw, settings.max_json_depth)
            # The submit route always answers 202 and reads no preference.
            prefs = (
                NO_PREFERENCES if force_async else parse_prefer(request.headers.getlist("prefer"))
            )
        except ThawError as exc:
            _refused(instance, name, exc)
            raise
        # `respond-async` alone: 202 at once. With `wait=S` too, the common reading of
        # RFC 7240 (§4.1, §4.3): answer within S seconds if the work can, else 202.
        outcome = await instance.dispatcher.invoke(
            name,
            event,
            wait_s=prefs.wait_s,
            respond_async=force_async or (prefs.respond_async and prefs.wait_s is None),
            request_id=request_id_of(request),
            key_id=key_id_of(request),
            stream=not force_async and sse.wants_events(request.headers.get("accept", "")),
        )
        if isinstance(outcome, Streaming):
            timing = {"Server-Timing": server_timing(outcome.timings_ms)}
            return await sse.invocation_response(
                outcome.stream, settings.sse_heartbeat_s, request.url.path, timing
            )
        if isinstance(outcome, Accepted):
            applied = "respond-async" if prefs.respond_async else None
            return job_response(outcome.job, 202, outcome.retry_after_s, applied=applied)
        assert isinstance(outcome, Completed)
        body = encode_output(name, outcome.output)
        return Response(
            body,
            media_type="application/json",
            headers={"Server-Timing": server_timing(outcome.timings_ms, outcome.batch_size)},
        )
    finally:
        intake.release(size)


async def invoke(request: Request) -> Response | sse.EventStreamResponse:
    """Invoke a handler; 200 with its output (or its event stream with
    `Accept: text/event-stream`), or 202 with a job past the deadline."""
    return await _invoke(request, force_async=False)


async def submit_job(request: Request) -> Response | sse.EventStreamResponse:
    """Submit a job: invoke a handler asynchronously; always 202 with the job."""
    return await _invoke(request, force_async=True)


# RFC 9745: the date `POST /jobs/{handler}` was deprecated (2026-12-01), as @epoch-seconds.
_DEPRECATED = "@1796083200"


async def submit_job_deprecated(request: Request) -> Response:
    """`POST /jobs/{handler}`: the submit route before `POST /handlers/{handler}/jobs`."""
    response = await _invoke(request, force_async=True)
    assert isinstance(response, Response)  # a submit never streams
    successor = f"/handlers/{quote(request.path_params['handler'], safe='')}/jobs"
    response.headers["Deprecation"] = _DEPRECATED
    response.headers["Link"] = f'<{successor}>; rel="successor-version"'
    return response


class DeprecatedSubmitRoute(Route):
    """The route of `submit_job_deprecated`: only where `{handler}` names a handler.

    `POST /jobs/{handler}` and `GET|DELETE /jobs/{job_id}` differ only in the
    name of their template's variable, which OpenAPI 3.1 forbids: the alias is
    left out of the document, and matches only a registered handler's name (a
    job id, 22 random characters, is none). Any other `POST /jobs/{x}` is 405
    with `Allow: DELETE, GET, HEAD`, as the document says.
    """

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child = super().matches(scope)
        if match is Match.NONE:
            return match, child
        app = scope.get("app")
        instance = getattr(getattr(app, "state", None), "instance", None)
        if instance is None or child["path_params"]["handler"] not in instance.registry.handlers:
            return Match.NONE, {}
        return match, child


def _wait_param(request: Request) -> float:
    raw = request.query_params.get("wait", "0")
    try:
        wait_s = float(raw)
    except ValueError:
        raise BadRequest(f"wait={raw!r} is not a number of seconds") from None
    if not math.isfinite(wait_s) or wait_s < 0:
        raise BadRequest(f"wait={raw!r} must be a non-negative number of seconds")
    return min(wait_s, 60.0)


async def get_job(request: Request) -> Response | sse.EventStreamResponse:
    """The job object; `?wait=S` long-polls up to S seconds for a final state. A running
    stream's job shows its output so far; `Accept: text/event-stream` follows it."""
    instance = _instance(request)
    if sse.wants_events(request.headers.get("accept", "")):
        return await follow_job(request)
    job = await instance.jobs.get(
        request.path_params["job_id"], key_id=key_id_of(request), wait_s=_wait_param(request)
    )
    body = job.public()
    stream = instance.dispatcher.streams.get(job.id)
    if stream is not None and not job.status.final:
        # Held here: live, where the store has the last heartbeat's.
        body["progress"] = stream.partial()
    return JSONResponse(body)


async def follow_job(request: Request) -> sse.EventStreamResponse:
    """A job as server-sent events: its items so far and then as they come (when
    this instance runs it), then its output or error."""
    instance = _instance(request)
    job_id = request.path_params["job_id"]
    key_id = key_id_of(request)
    job = await instance.jobs.get(job_id, key_id=key_id)  # 404 before any 200
    heartbeat_s = instance.settings.sse_heartbeat_s
    path = request.url.path
    last = request.headers.get("last-event-id", "")
    start = int(last) + 1 if last.isdigit() else 0

    async def events() -> AsyncIterator[bytes]:
        current = job
        stream = instance.dispatcher.streams.get(job_id)
        if stream is not None and not current.status.final:
            async for chunk in sse.stream_events(stream, start, heartbeat_s, path):
                yield chunk
            return
        # Not streamed here (run by another instance, or finished): its end.
        while not current.status.final:
            yield sse.HEARTBEAT
            current = await instance.jobs.get(job_id, key_id=key_id, wait_s=heartbeat_s)
        yield sse.job_final_event(current, path)

    return sse.EventStreamResponse(events())


async def cancel_job(request: Request) -> Response:
    """Cancel a job that has not finished."""
    job = await _instance(request).jobs.cancel(
        request.path_params["job_id"], key_id=key_id_of(request)
    )
    return JSONResponse(job.public())


async def list_models(request: Request) -> Response:
    """Every bundle: id, state, bytes, phase times, loads, hits, last use, estimate."""
    instance = _instance(request)
    cache = instance.cache
    names = set(instance.registry.bundle_names()) | set(cache.entries)
    views = []
    for name in sorted(names):
        entry = cache.entry(name)
        if entry.manifest is None:
            with contextlib.suppress(ThawError):
                await cache.manifest_of(name)
        views.append(cache.describe(entry))
    return JSONResponse(
        {
            "models": views,
            "budget_bytes": cache.budget.limit,
            "reserved_bytes": cache.reserved_bytes(),
            "waiting_for_memory": cache.budget.waiting(),
        }
    )


def _known_bundle(instance: Instance, name: str) -> str:
    if instance.registry.builder(name) is None:
        raise UnknownBundle(f"no bundle named {name!r}")
    return name


async def load_model(request: Request) -> Response:
    """Prewarm a bundle in the background (202)."""
    instance = _instance(request)
    name = _known_bundle(instance, request.path_params["name"])
    if instance.draining:
        raise Draining("this instance is draining")
    instance.spawn(instance.prewarm(name))
    await asyncio.sleep(0)
    return JSONResponse(instance.cache.describe(instance.cache.entry(name)), status_code=202)


async def unload_model(request: Request) -> Response:
    """Unload a bundle once its in-flight requests finish."""
    instance = _instance(request)
    name = _known_bundle(instance, request.path_params["name"])
    await instance.cache.unload(name)
    return JSONResponse(instance.cache.describe(instance.cache.entry(name)))


async def healthz(request: Request) -> Response:
    """200 as soon as the process serves."""
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    """200 once the prewarm set is READY and the instance is healthy and not draining."""
    instance = _instance(request)
    if instance.ready():
        return JSONResponse({"status": "ready"})
    waiting = [n for n in instance.settings.prewarm if not instance.cache.is_ready(n)]
    if instance.draining:
        status = "draining"
    elif not instance.health.ok:
        status = "unhealthy"
    else:
        status = "warming"
    body = {"status": status, "waiting": waiting, "conditions": instance.health.describe()}
    return JSONResponse(body, status_code=503)


async def drain(request: Request) -> Response:
    """Readiness off, in-flight work finishes, the rest is aborted, then the process exits."""
    _instance(request).begin_drain("POST /drain")
    return JSONResponse({"status": "draining"}, status_code=202)


async def metrics(request: Request) -> Response:
    """Prometheus text format."""
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(_instance(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def openapi_document(request: Request) -> Response:
    """The OpenAPI 3.1 description of this HTTP contract."""
    document: bytes | None = getattr(request.app.state, "openapi", None)
    if document is None:
        from runtime.http.openapi import build_openapi

        auth = getattr(request.app.state, "auth", False)
        document = orjson.dumps(build_openapi(ROUTES, auth=auth))
        request.app.state.openapi = document
    return Response(document, media_type="application/json")


ROUTES = [
    Route("/invoke/{handler}", invoke, methods=["POST"]),
    Route("/handlers/{handler}/jobs", submit_job, methods=["POST"]),
    Route("/jobs/{job_id}", get_job, methods=["GET"]),
    Route("/jobs/{job_id}", cancel_job, methods=["DELETE"]),
    # After the routes of /jobs/{job_id}: consulted only for a POST there.
    DeprecatedSubmitRoute(
        "/jobs/{handler}", submit_job_deprecated, methods=["POST"], include_in_schema=False
    ),
    Route("/models", list_models, methods=["GET"]),
    Route("/models/{name}/load", load_model, methods=["POST"]),
    Route("/models/{name}", unload_model, methods=["DELETE"]),
    Route("/healthz", healthz, methods=["GET"]),
    Route("/readyz", readyz, methods=["GET"]),
    Route("/drain", drain, methods=["POST"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/openapi.json", openapi_document, methods=["GET"]),
]


def create_app(
    settings: Settings | None = None,
    instance: Instance | None = None,
    *,
    defer_background: bool = False,
) -> Starlette:
    """The ASGI app. Its lifespan starts the instance and drains it on shutdown.

    With `defer_background`, prewarm and job recovery wait for
    `app.state.instance.start_background()` (the server calls it once listening).
    """
    settings = settings if settings is not None else Settings.from_env()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        inst = instance if instance is not None else Instance.create(settings)
        app.state.instance = inst
        observed.requests = inst.metrics.requests
        await inst.start(background=not defer_background)
        try:
            yield
        finally:
            await inst.stop()

    observed = Observed()
    keys = KeyRing.from_settings(settings)
    middleware = [Middleware(Edge, observed)]
    if keys is not None:
        middleware.append(Middleware(AuthMiddleware, keys, problem_response))
    app = Starlette(
        routes=ROUTES,
        middleware=middleware,
        lifespan=lifespan,
        # Starlette re-raises what its `Exception` handler answered (uvicorn then logs
        # it as an error): classes answered as a matter of course are named here.
        exception_handlers={
            ThawError: render_error,
            HTTPException: render_error,
            ClientDisconnect: render_error,
            Exception: render_error,
        },
    )
    # A path is served as routed or not at all: `/invoke/echo/` is a 404 problem,
    # not a 307 to another URL that the contract (and its OpenAPI) never names.
    app.router.redirect_slashes = False
    app.state.settings = settings
    app.state.auth = keys is not None
    app.state.intake = Intake(settings.max_buffered_bytes, settings.body_timeout_s)
    # Set by the server once it stops: `Edge` then answers cut-off requests 503.
    app.state.stopping = False
    return app
