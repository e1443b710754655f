"""Model bundles: every bundle's state (`GET /models`), and loading or unloading one."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.requests import Request
from starlette.responses import Response

from runtime.errors import Draining, ThawError, UnknownBundle
from runtime.http.responses import JSONResponse
from runtime.http.routes import instance_of
from runtime.instance import Instance


async def list_models(request: Request) -> Response:
    """Every bundle: id, state, bytes, phase times, loads, hits, last use, estimate."""
    instance = instance_of(request)
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
    instance = instance_of(request)
    name = _known_bundle(instance, request.path_params["name"])
    if instance.draining:
        raise Draining("this instance is draining")
    instance.spawn(instance.prewarm(name))
    await asyncio.sleep(0)
    return JSONResponse(instance.cache.describe(instance.cache.entry(name)), status_code=202)


async def unload_model(request: Request) -> Response:
    """Unload a bundle once its in-flight requests finish."""
    instance = instance_of(request)
    name = _known_bundle(instance, request.path_params["name"])
    await instance.cache.unload(name)
    return JSONResponse(instance.cache.describe(instance.cache.entry(name)))
