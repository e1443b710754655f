"""The instance itself: liveness and readiness probes, drain, metrics, and the
OpenAPI document of the routes the app serves."""

from __future__ import annotations

import orjson
from starlette.requests import Request
from starlette.responses import Response

from runtime.http.auth import is_operator, require_operator
from runtime.http.responses import JSONResponse
from runtime.http.routes import instance_of


async def healthz(request: Request) -> Response:
    """200 as soon as the process serves."""
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    """200 once the prewarm set is READY and the instance is healthy and not draining.

    A handler module that failed to import does not fail readiness (the others
    serve): `broken_modules` lists it, with its file, line and error for operators.

    Open to probes, which learn only the status (ready, warming, draining,
    unhealthy) and the classes of the conditions behind it: their details (a
    database path, a job id) go to the log and to operator callers.
    """
    instance = instance_of(request)
    operator = is_operator(request)
    body = instance.readiness(details=operator)
    if instance.registry.broken:
        # Still ready: the other handlers serve, and failing the probe would take
        # them out of rotation too. Where it broke (file, line, error) is a detail.
        body["broken_modules"] = [
            b.describe() if operator else {"module": b.module} for b in instance.registry.broken
        ]
    return JSONResponse(body, status_code=200 if body["status"] == "ready" else 503)


async def drain(request: Request) -> Response:
    """Readiness off, in-flight work finishes, the rest is aborted, then the process exits;
    an operator's action."""
    require_operator(request)
    instance_of(request).begin_drain("POST /drain")
    return JSONResponse({"status": "draining"}, status_code=202)


async def metrics(request: Request) -> Response:
    """Prometheus text format."""
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(await instance_of(request).metrics_text(), media_type=CONTENT_TYPE_LATEST)


async def openapi_document(request: Request) -> Response:
    """The OpenAPI 3.1 description of this HTTP contract."""
    document: bytes | None = getattr(request.app.state, "openapi", None)
    if document is None:
        from runtime.http.openapi import build_openapi

        auth = getattr(request.app.state, "auth", False)
        document = orjson.dumps(build_openapi(request.app.routes, auth=auth))
        request.app.state.openapi = document
    return Response(document, media_type="application/json")
