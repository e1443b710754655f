"""The HTTP contract as a Starlette app. Endpoints are module-level functions;
errors are rendered in one place (`render_error`) as application/problem+json.

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
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.dispatch.dispatcher import Accepted, Completed
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
from runtime.http.auth import AuthMiddleware, KeyRing
from runtime.http.prefer import parse_prefer
from runtime.instance import Instance
from runtime.jobs.job import Job
from runtime.outputs import encode_output
from runtime.settings import Settings

log = logging.getLogger("thaw.app")

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


def problem_response(exc: ThawError, instance: str | None = None) -> Response:
    headers: dict[str, str] = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    if exc.status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="thaw"'
    if isinstance(exc, MethodNotAllowed):
        headers["Allow"] = ", ".join(exc.allow)
    if isinstance(exc, _CLOSES_CONNECTION):
        # The rest of the body is never read: the connection cannot carry another request.
        headers["Connection"] = "close"
    return Response(
        orjson.dumps(exc.to_problem(instance), default=str),
        status_code=exc.status,
        headers=headers,
        media_type=PROBLEM,
    )


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path (several routes may share one)."""
    methods: set[str] = set()
    for route in request.app.routes:
        if isinstance(route, Route) and route.matches(request.scope)[0] is not Match.NONE:
            methods |= route.methods or set()
    return sorted(methods)


async def render_error(request: Request, exc: Exception) -> Response:
    """The one place errors become HTTP responses."""
    if isinstance(exc, ThawError):
        return problem_response(exc, request.url.path)
    if isinstance(exc, HTTPException):
        # Starlette's own routing errors (404 no route, 405 wrong method).
        if exc.status_code == 404:
            return problem_response(
                NotFound(f"no route for {request.method} {request.url.path}"), request.url.path
            )
        if exc.status_code == 405:
            allow = _allowed_methods(request)
            return problem_response(
                MethodNotAllowed(
                    f"{request.method} is not allowed on {request.url.path}; "
                    f"allowed: {', '.join(allow)}",
                    allow=allow,
                ),
                request.url.path,
            )
        body = ThawError(exc.detail or "error").to_problem(request.url.path)
        body.update(status=exc.status_code, title=HTTPStatus(exc.status_code).phrase)
        return Response(orjson.dumps(body), status_code=exc.status_code, media_type=PROBLEM)
    if isinstance(exc, ClientDisconnect):
        # The client's own doing, not a fault here: no traceback, and nobody to answer.
        log.info(
            "client disconnected before its request body arrived: %s %s",
            request.method,
            request.url.path,
        )
        return problem_response(BadRequest("client disconnected"), request.url.path)
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return problem_response(ThawError("internal error; see the server log"), request.url.path)


def _stopping(scope: Scope) -> bool:
    """True once the server stops (runtime.http.server sets `app.state.stopping`)."""
    app = scope.get("app")
    return bool(getattr(getattr(app, "state", None), "stopping", False))


class Edge:
    """The app's outer edge: pure ASGI, and one frame for both of its jobs.

    Refuses a request whose header block exceeds MAX_HEADER_BYTES: uvicorn's
    h11 limit (server.py) bounds only a header block still arriving in pieces;
    one that arrives whole in a single read is parsed however large. This
    bounds both, with a problem+json answer naming the limit.

    Answers a request cut off by the server's shutdown (runtime.http.server
    cancels what still runs when it stops: a long-poll, a body still arriving)
    with 503 `drained`, where the cancellation would otherwise reach uvicorn,
    which answers a text/plain 500 and logs a traceback. Only then: any other
    cancellation (the Lambda loop stopping its workers) goes on as it came.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = sum(len(name) + len(value) + 4 for name, value in scope["headers"])
            if size > MAX_HEADER_BYTES:
                exc = BadRequest(
                    f"request headers of {size} bytes exceed the {MAX_HEADER_BYTES}-byte limit",
                    limit_bytes=MAX_HEADER_BYTES,
                )
                await problem_response(exc, scope["path"])(scope, receive, send)
                return
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            if scope["type"] != "http" or not _stopping(scope):
                raise
            cut_off = Draining("the server shut down before this request finished; send it again")
            # RuntimeError: the response had started already, and the connection
            # closes with it half sent, which is all there is left to do.
            with contextlib.suppress(RuntimeError):
                await problem_response(cut_off, scope["path"])(scope, receive, send)


def _instance(request: Request) -> Instance:
    instance: Instance = request.app.state.instance
    return instance


# A random prefix per process and a counter: unique ids without drawing random
# bytes on every request (request ids label logs; they are not secrets).
_ID_PREFIX = secrets.token_hex(6)
_ID_COUNTER = itertools.count(1)


def _request_id(request: Request) -> str:
    # getlist, not get: Headers.get of a missing header raises and catches a KeyError.
    given = request.headers.getlist("x-request-id")
    if given and _REQUEST_ID.match(given[0]):
        return given[0]
    return f"{_ID_PREFIX}-{next(_ID_COUNTER):x}"


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
def server_timing(timings_ms: dict[str, float]) -> str:
    """The Server-Timing value; the dispatcher fills `timings_ms` in phase order."""
    return ", ".join([f"{name};dur={ms:.3f}" for name, ms in timings_ms.items()])


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


async def _invoke(request: Request, *, force_async: bool) -> Response:
    state = request.app.state
    instance: Instance = state.instance
    intake: Intake = state.intake
    settings = instance.settings
    raw = await intake.read(request, settings.max_body_bytes)
    try:  # the body's bytes count against THAW_MAX_BUFFERED_BYTES until the answer
        event = parse_json(raw, settings.max_json_depth)
        prefs = parse_prefer(request.headers.getlist("prefer"))
        request_id = _request_id(request)
        name = request.path_params["handler"]
        outcome = await instance.dispatcher.invoke(
            name,
            event,
            wait_s=prefs.wait_s,
            respond_async=force_async or prefs.respond_async,
            request_id=request_id,
            key_id=key_id_of(request),
        )
        if isinstance(outcome, Accepted):
            applied = "respond-async" if prefs.respond_async else None
            return job_response(outcome.job, 202, outcome.retry_after_s, applied=applied)
        assert isinstance(outcome, Completed)
        body = encode_output(name, outcome.output)
        return Response(
            body,
            media_type="application/json",
            headers={
                "Server-Timing": server_timing(outcome.timings_ms),
                "X-Request-Id": request_id,
            },
        )
    finally:
        intake.release(len(raw))


async def invoke(request: Request) -> Response:
    """Invoke a handler; 200 with its output, or 202 with a job past the deadline."""
    return await _invoke(request, force_async=False)


async def submit_job(request: Request) -> Response:
    """Invoke a handler asynchronously; always 202 with a job."""
    return await _invoke(request, force_async=True)


def _wait_param(request: Request) -> float:
    raw = request.query_params.get("wait", "0")
    try:
        wait_s = float(raw)
    except ValueError:
        raise BadRequest(f"wait={raw!r} is not a number of seconds") from None
    if not math.isfinite(wait_s) or wait_s < 0:
        raise BadRequest(f"wait={raw!r} must be a non-negative number of seconds")
    return min(wait_s, 60.0)


async def get_job(request: Request) -> Response:
    """The job object; `?wait=S` long-polls up to S seconds for a final state."""
    job = await _instance(request).jobs.get(
        request.path_params["job_id"], key_id=key_id_of(request), wait_s=_wait_param(request)
    )
    return JSONResponse(job.public())


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
    Route("/jobs/{handler}", submit_job, methods=["POST"]),
    Route("/jobs/{job_id}", get_job, methods=["GET"]),
    Route("/jobs/{job_id}", cancel_job, methods=["DELETE"]),
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
        app.state.dispatcher = inst.dispatcher
        await inst.start(background=not defer_background)
        try:
            yield
        finally:
            await inst.stop()

    keys = KeyRing.from_settings(settings)
    middleware = [Middleware(Edge)]
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
