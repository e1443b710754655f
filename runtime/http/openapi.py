"""The OpenAPI 3.1 description of the HTTP contract, built from the route table.

Paths and methods come from the routes (`runtime.http.app.ROUTES`, passed in, so
this module never imports the app); what each operation takes and answers
comes from `OPERATIONS`, keyed by the endpoint's function name, which is also
the operationId; the summary is the endpoint docstring's first line.
`build_openapi` refuses a route without an entry and an entry without a
route, so the description cannot drift from the code. The components the
operations refer to (schemas, parameters, headers, error responses) are
runtime/http/schemas.py's.

A job is submitted with `POST /handlers/{handler}/jobs`. The route it
replaces, `POST /jobs/{handler}`, differed from `GET|DELETE /jobs/{job_id}`
only in its variable's name, which OpenAPI 3.1 forbids (templated paths that
differ only in their names are identical); it still answers, deprecated, and
is left out of this document (runtime.http.routes.jobs.DeprecatedSubmitRoute), so no
path here is another in disguise. A 202's `links` lead from the job it
answers to its poll and its cancel.

Every response declares the X-Request-Id it carries (`components/headers`);
every operation takes one (`components/parameters/RequestId`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from starlette.routing import BaseRoute, Route

from runtime.http.openai import openapi as openai_doc
from runtime.http.problems import PROBLEM
from runtime.http.schemas import (
    HEADERS,
    PARAMETERS,
    RETRY_AFTER,
    SCHEMAS,
    error_responses,
    errors,
    json_response,
    ref,
)
from runtime.version import __version__

# Importable from here, where the document is.
__all__ = ["OPERATIONS", "PROBLEM", "build_openapi", "http_routes"]

_PARAM = re.compile(r"{([^}:]+)(?::[^}]+)?}")

# Server-sent events (runtime/http/sse.py), with `Accept: text/event-stream`.
_EVENT_STREAM = {
    "text/event-stream": {
        "schema": {
            "type": "string",
            "description": (
                "One event per item a generator handler yields (`id: <index>`, `data: <item "
                "JSON>`), as soon as it exists; then `event: result` with the output (the "
                "items joined), or `event: error` with a problem+json object if the handler "
                "failed midway; `: keep-alive` comments after THAW_SSE_HEARTBEAT_S of quiet"
            ),
        }
    }
}

_JOB_HEADERS = {
    "Location": {"description": "/jobs/{id}", "schema": {"type": "string"}, "required": True},
    "Retry-After": RETRY_AFTER,
    "Preference-Applied": {"schema": {"type": "string"}},
}
# From the job a 202 answers to what a client does next with it.
_JOB_LINKS = {
    "GetJob": {
        "operationId": "get_job",
        "parameters": {"job_id": "$response.body#/id"},
        "description": "poll the job (its Location); `?wait=S` long-polls for its end",
    },
    "CancelJob": {
        "operationId": "cancel_job",
        "parameters": {"job_id": "$response.body#/id"},
        "description": "cancel the job while it has not finished",
    },
}
_ACCEPTED = json_response(
    ref("schemas", "Job"), "a job; poll its Location", headers=_JOB_HEADERS, links=_JOB_LINKS
)
_VARY = {"Vary": ref("headers", "VaryPrefer")}
_EVENT_BODY = {
    "required": False,
    "description": "the JSON event handed to the handler (an empty body is `{}`)",
    "content": {"application/json": {"schema": {}}},
}
_NAME = {"type": "string", "minLength": 1}


# Per endpoint: parameters (path parameters come from the route), body, responses.
OPERATIONS: dict[str, dict[str, Any]] = {
    "invoke": {
        "parameters": [ref("parameters", "Prefer")],
        "requestBody": _EVENT_BODY,
        "responses": {
            "200": json_response(
                {},
                "the handler's output; with `Accept: text/event-stream`, its items as "
                "server-sent events as they are made",
                content_extra=_EVENT_STREAM,
                headers={
                    "Server-Timing": {
                        "description": (
                            "queue, fetch, load, init, warmup, batch, run (ms); a batched "
                            'handler\'s `batch` (the wait for its batch) has desc="n=<size>"'
                        ),
                        "schema": {"type": "string"},
                    },
                    **_VARY,
                },
            ),
            "202": {**_ACCEPTED, "headers": {**_JOB_HEADERS, **_VARY}},
            **errors(400, 404, 408, 413, 429, 500, 503),
        },
    },
    "submit_job": {
        "requestBody": _EVENT_BODY,
        "responses": {"202": _ACCEPTED, **errors(400, 404, 408, 413, 429, 500, 503)},
    },
    "get_job": {
        "parameters": [
            {
                "name": "wait",
                "in": "query",
                "description": (
                    "long-poll up to this many seconds (at most THAW_MAX_WAIT_S, 60 by "
                    "default) for a final state"
                ),
                "schema": {"type": "number", "minimum": 0},
            }
        ],
        "responses": {
            "200": json_response(
                ref("schemas", "Job"),
                "the job; with `Accept: text/event-stream`, its items so far and then as "
                "they come (after `Last-Event-ID`, when given), then its output or error",
                content_extra=_EVENT_STREAM,
            ),
            # 429: the key holds THAW_MAX_HELD_PER_KEY connections; 503: the instance
            # holds THAW_MAX_HELD, or the server's shutdown cut the long-poll off.
            **errors(400, 404, 429, 500, 503),
        },
    },
    "cancel_job": {
        "responses": {
            "200": json_response(ref("schemas", "Job"), "the job, cancelled unless already final"),
            **errors(404, 500),
        },
    },
    "list_models": {
        "responses": {
            "200": json_response(ref("schemas", "Models"), "every bundle"),
            **errors(500),
        },
    },
    "load_model": {
        "responses": {
            "202": json_response(
                ref("schemas", "Model"),
                "loading in the background",
                links={
                    "UnloadModel": {
                        "operationId": "unload_model",
                        "parameters": {"bundle": "$request.path.bundle"},
                        "description": "unload the bundle again",
                    }
                },
            ),
            **errors(404, 500, 503),
        },
    },
    "unload_model": {
        "responses": {
            "200": json_response(ref("schemas", "Model"), "unloaded"),
            **errors(404, 500),
        },
    },
    "healthz": {
        "security": [],
        "responses": {"200": json_response(ref("schemas", "Status"), "the process serves")},
    },
    "readyz": {
        "security": [],
        "responses": {
            "200": json_response(ref("schemas", "Status"), "ready"),
            "503": json_response(ref("schemas", "Status"), "warming or draining"),
        },
    },
    "drain": {
        "responses": {"202": json_response(ref("schemas", "Status"), "draining"), **errors(500)},
    },
    "metrics": {
        "responses": {
            "200": {
                "description": "Prometheus text format",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            },
            **errors(500),
        },
    },
    "openapi_document": {
        "responses": {"200": json_response({"type": "object"}, "this document"), **errors(500)},
    },
    # The /v1 routes: OpenAI's wire format, and its error body (runtime/http/openai/).
    **openai_doc.OPERATIONS,
}


# Instance-wide actions: with keys configured, only an operator key reaches them.
OPERATOR_ONLY = frozenset({"drain", "load_model", "unload_model"})


def _summary(endpoint: Any) -> str:
    doc = (getattr(endpoint, "__doc__", None) or "").strip()
    return doc.splitlines()[0] if doc else endpoint.__name__


def _operation(route: Route, auth: bool) -> dict[str, Any]:
    name = route.endpoint.__name__
    if name not in OPERATIONS:
        raise KeyError(
            f"route {route.path} ({name}) has no entry in runtime.http.openapi.OPERATIONS"
        )
    fragment = dict(OPERATIONS[name])
    responses = dict(fragment.pop("responses"))
    open_endpoint = fragment.get("security") == []
    if auth and not open_endpoint:
        openai = name in openai_doc.OPERATIONS
        responses.update(openai_doc.openai_errors(401) if openai else errors(401))
    if auth and name in OPERATOR_ONLY:
        responses.update(errors(403))
    if not auth:
        fragment.pop("security", None)
    path_params = [
        {"name": p, "in": "path", "required": True, "schema": _NAME}
        for p in _PARAM.findall(route.path)
    ]
    for status, response in responses.items():
        if "$ref" not in response:  # the shared ones (errors) declare it themselves
            headers = {**response.get("headers", {}), "X-Request-Id": ref("headers", "RequestId")}
            responses[status] = {**response, "headers": headers}
    parameters = [*path_params, *fragment.get("parameters", []), ref("parameters", "RequestId")]
    return {
        "operationId": name,
        "summary": _summary(route.endpoint),
        **fragment,
        "parameters": parameters,
        "responses": responses,
    }


def http_routes(routes: Iterable[BaseRoute]) -> list[Route]:
    return [r for r in routes if isinstance(r, Route) and r.include_in_schema]


def build_openapi(routes: Sequence[BaseRoute], *, auth: bool) -> dict[str, Any]:
    """The OpenAPI document for `routes`; with `auth`, every operation but the probes
    requires a bearer key."""
    paths: dict[str, dict[str, Any]] = {}
    used: set[str] = set()
    for route in http_routes(routes):
        used.add(route.endpoint.__name__)
        for method in sorted((route.methods or set()) - {"HEAD"}):
            paths.setdefault(_PARAM.sub(r"{\1}", route.path), {})[method.lower()] = _operation(
                route, auth
            )
    unused = set(OPERATIONS) - used
    if unused:
        raise KeyError(f"runtime.http.openapi.OPERATIONS describes no route: {sorted(unused)}")
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "Thaw",
            "version": __version__,
            "description": (
                "Serverless function runtime for GPU inference: the HTTP contract. "
                "Errors are RFC 9457 problems (application/problem+json). Any path "
                "answers a method it does not serve with 405 and `Allow` "
                "(#/components/responses/MethodNotAllowed); paths are matched exactly, "
                "so a trailing slash is 404, never a redirect. Every answer carries "
                "X-Request-Id. `POST /jobs/{handler}`, the submit route before "
                "`POST /handlers/{handler}/jobs`, still answers for a known handler, "
                "with `Deprecation` and a `Link` to its successor; it is not described "
                "here, as OpenAPI 3.1 forbids it beside `/jobs/{job_id}`. Under /v1/, "
                "OpenAI's wire format: errors there are OpenAI's error body "
                "(#/components/schemas/OpenAIError)."
            ),
        },
        "paths": paths,
        "components": {
            "schemas": {**SCHEMAS, **openai_doc.SCHEMAS},
            "parameters": PARAMETERS,
            "headers": HEADERS,
            "responses": error_responses(),
        },
    }
    if auth:
        document["components"]["securitySchemes"] = {
            "apiKey": {
                "type": "http",
                "scheme": "bearer",
                "description": "a THAW_API_KEYS key (its sha256 may be in THAW_API_KEYS_FILE)",
            }
        }
        document["security"] = [{"apiKey": []}]
    return document
