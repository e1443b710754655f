"""The HTTP contract as a Starlette app: the route table and the app factory.

The parts, one noun each: `Edge` (edge.py) meets every request first: its id,
its header bound, its access-log line; `Intake` (intake.py) reads request
bodies within their limits and parses them as JSON; the endpoints
(routes/: invoke, jobs, models, health) ask the `Instance` and render its
answer; problems.py is the one place an exception becomes a problem+json
answer.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.middleware import Middleware

from runtime.clock import SYSTEM
from runtime.http.auth import AuthMiddleware, KeyRing
from runtime.http.edge import Edge, RequestTiming
from runtime.http.holds import Holds
from runtime.http.intake import Intake, parse_json
from runtime.http.problems import problem_response
from runtime.http.responses import server_timing
from runtime.http.routes.health import drain, healthz, metrics, openapi_document, readyz
from runtime.http.routes.invoke import invoke
from runtime.http.routes.jobs import (
    DeprecatedSubmitRoute,
    cancel_job,
    get_job,
    submit_job,
    submit_job_deprecated,
)
from runtime.http.routes.models import list_models, load_model, unload_model
from runtime.http.routes.openai import (
    create_chat_completion,
    create_completion,
    create_embeddings,
    get_openai_model,
    list_openai_models,
)
from runtime.http.routing import Endpoint, ThawApp
from runtime.instance import Instance
from runtime.registry import Registry
from runtime.settings import Settings
from runtime.telemetry.logs import DEFERRED_LOGS

log = logging.getLogger("thaw.registry")

# Importable from here as before the app's parts had modules of their own.
__all__ = ["ROUTES", "create_app", "parse_json", "problem_response", "server_timing"]

ROUTES = [
    Endpoint("/invoke/{handler}", invoke, methods=["POST"]),
    Endpoint("/handlers/{handler}/jobs", submit_job, methods=["POST"]),
    Endpoint("/jobs/{job_id}", get_job, methods=["GET"]),
    Endpoint("/jobs/{job_id}", cancel_job, methods=["DELETE"]),
    # After the routes of /jobs/{job_id}: consulted only for a POST there.
    DeprecatedSubmitRoute(
        "/jobs/{handler}", submit_job_deprecated, methods=["POST"], include_in_schema=False
    ),
    Endpoint("/models", list_models, methods=["GET"]),
    Endpoint("/models/{bundle}/load", load_model, methods=["POST"]),
    Endpoint("/models/{bundle}", unload_model, methods=["DELETE"]),
    Endpoint("/healthz", healthz, methods=["GET"]),
    Endpoint("/readyz", readyz, methods=["GET"]),
    Endpoint("/drain", drain, methods=["POST"]),
    Endpoint("/metrics", metrics, methods=["GET"]),
    Endpoint("/openapi.json", openapi_document, methods=["GET"]),
    # OpenAI's wire format over the handlers that declare it (routes/openai.py).
    Endpoint("/v1/embeddings", create_embeddings, methods=["POST"]),
    Endpoint("/v1/chat/completions", create_chat_completion, methods=["POST"]),
    Endpoint("/v1/completions", create_completion, methods=["POST"]),
    Endpoint("/v1/models", list_openai_models, methods=["GET"]),
    Endpoint("/v1/models/{model:path}", get_openai_model, methods=["GET"]),
]


def create_app(
    settings: Settings | None = None,
    instance: Instance | None = None,
    *,
    defer_background: bool = False,
    registry: Registry | None = None,
) -> Starlette:
    """The ASGI app. Its lifespan starts the instance and drains it on shutdown.

    With `defer_background`, prewarm and job recovery wait for
    `app.state.instance.start_background()` (the server calls it once listening).
    `registry`: handlers already discovered (`thaw serve` does it before it listens,
    so that nothing to serve is one error line, not a failed lifespan).
    """
    settings = settings if settings is not None else Settings.from_env()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        inst = instance if instance is not None else Instance.create(settings, registry)
        for broken in inst.registry.broken:
            # The instance serves the other handlers; this names what it does not.
            log.warning(
                "handler module %s; its handlers are not served: %s",
                broken.summary(),
                ", ".join(broken.handlers) or "none found in its source",
            )
        app.state.instance = inst
        timing.requests = inst.request_stats
        await inst.start(background=not defer_background)
        try:
            yield
        finally:
            await inst.stop()
            # What the instance answered and ended is logged by the time it has stopped.
            DEFERRED_LOGS.flush()

    # The instance's clock, once known here (else the system's, as Instance.create's).
    clock = instance.clock if instance is not None else SYSTEM
    timing = RequestTiming(clock)
    keys = KeyRing.from_settings(settings)
    middleware = [Middleware(Edge, timing)]
    if keys is not None:
        middleware.append(Middleware(AuthMiddleware, keys, problem_response))
    # `Edge` first: with no middleware of Starlette's own (routing.py), it renders
    # every exception a route raises.
    app = ThawApp(routes=ROUTES, middleware=middleware, lifespan=lifespan)
    # A path is served as routed or not at all: `/invoke/echo/` is a 404 problem,
    # not a 307 to another URL that the contract (and its OpenAPI) never names.
    app.router.redirect_slashes = False
    app.state.settings = settings
    app.state.auth = keys is not None
    app.state.intake = Intake(settings.max_buffered_bytes, settings.body_timeout_s, clock)
    app.state.holds = Holds(settings.max_held, settings.max_held_per_key)
    # Set by the server once it stops: `Edge` then answers cut-off requests 503.
    app.state.stopping = False
    return app
