"""The HTTP contract as a Starlette app. Endpoints are module-level functions;
errors are rendered in one place (`render_error`) as application/problem+json.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import re
import secrets
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.dispatch.dispatcher import Accepted, Completed
from runtime.errors import (
    BadRequest,
    Draining,
    InvalidJSON,
    NotFound,
    PayloadTooLarge,
    ThawError,
    UnknownBundle,
)
from runtime.http.auth import AuthMiddleware, KeyRing
from runtime.http.prefer import parse_prefer
from runtime.instance import Instance
from runtime.jobs.job import Job
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


def problem_response(exc: ThawError, instance: str | None = None) -> Response:
    headers: dict[str, str] = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    if exc.status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="thaw"'
    return Response(
        orjson.dumps(exc.to_problem(instance), default=str),
        status_code=exc.status,
        headers=headers,
        media_type=PROBLEM,
    )


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
        body = ThawError(exc.detail or "error").to_problem(request.url.path)
        body.update(status=exc.status_code, title=HTTPStatus(exc.status_code).phrase)
        return Response(orjson.dumps(body), status_code=exc.status_code, media_type=PROBLEM)
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return problem_response(ThawError("internal error; see the server log"), request.url.path)


class HeaderLimit:
    """Refuse a request whose header block exceeds MAX_HEADER_BYTES (pure ASGI: cheap).

    uvicorn's h11 limit (server.py) bounds only a header block still arriving
    in pieces; one that arrives whole in a single read is parsed however large.
    This bounds both, with a problem+json answer naming the limit.
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
        await self.app(scope, receive, send)


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


async def read_json(request: Request, limit: int, max_depth: int = 64) -> Any:
    """The body as JSON, refusing bodies over `limit` bytes before reading them whole,
    and documents nested deeper than `max_depth`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(
            f"body of {declared} bytes exceeds THAW_MAX_BODY_BYTES={limit}", limit_bytes=limit
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"body exceeds THAW_MAX_BODY_BYTES={limit}", limit_bytes=limit)
        chunks.append(chunk)
    body = b"".join(chunks)
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
    instance = _instance(request)
    prefs = parse_prefer(request.headers.getlist("prefer"))
    settings = instance.settings
    event = await read_json(request, settings.max_body_bytes, settings.max_json_depth)
    request_id = _request_id(request)
    outcome = await instance.dispatcher.invoke(
        request.path_params["handler"],
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
    try:
        body = orjson.dumps(outcome.output, option=_JSON_OPTS)
    except TypeError as exc:
        raise ThawError(f"handler output is not JSON-serialisable: {exc}") from exc
    return Response(
        body,
        media_type="application/json",
        headers={"Server-Timing": server_timing(outcome.timings_ms), "X-Request-Id": request_id},
    )


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
    middleware = [Middleware(HeaderLimit)]
    if keys is not None:
        middleware.append(Middleware(AuthMiddleware, keys, problem_response))
    app = Starlette(
        routes=ROUTES,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={
            ThawError: render_error,
            HTTPException: render_error,
            Exception: render_error,
        },
    )
    app.state.settings = settings
    app.state.auth = keys is not None
    return app
