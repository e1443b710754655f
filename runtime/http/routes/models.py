"""Model bundles: every bundle's state (`GET /models`), and loading or unloading one."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from runtime.http.auth import is_operator, require_operator
from runtime.http.responses import JSONResponse
from runtime.http.routes import instance_of


async def list_models(request: Request) -> Response:
    """Every bundle: id, state, bytes, phase times, loads, hits, last use, estimate; and
    the handler modules that failed to import (handlers not served; for operators, also
    file, line and error)."""
    instance = instance_of(request)
    view = await instance.models_view()
    # Where a module broke (its file, line, error text) is an operator's detail,
    # as in /readyz; a tenant learns which handlers are not served.
    operator = is_operator(request)
    view["broken_modules"] = [
        b.describe() if operator else {"module": b.module, "handlers": list(b.handlers)}
        for b in instance.registry.broken
    ]
    return JSONResponse(view)


async def load_model(request: Request) -> Response:
    """Prewarm a bundle in the background (202); an operator's action."""
    require_operator(request)
    view = await instance_of(request).load_bundle(request.path_params["bundle"])
    return JSONResponse(view, status_code=202)


async def unload_model(request: Request) -> Response:
    """Unload a bundle once its in-flight requests finish; an operator's action."""
    require_operator(request)
    return JSONResponse(await instance_of(request).unload_bundle(request.path_params["bundle"]))
