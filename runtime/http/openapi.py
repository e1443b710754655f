"""The OpenAPI 3.1 description of the HTTP contract, built from the route table.

Paths and methods come from the routes (`runtime.http.app.ROUTES`, passed in, so
this module never imports the app); what each operation takes and answers
comes from `OPERATIONS`, keyed by the endpoint's function name, which is also
the operationId; the summary is the endpoint docstring's first line.
`build_openapi` refuses a route without an entry and an entry without a
route, so the description cannot drift from the code.

A job is submitted with `POST /handlers/{handler}/jobs`. The route it
replaces, `POST /jobs/{handler}`, differed from `GET|DELETE /jobs/{job_id}`
only in its variable's name, which OpenAPI 3.1 forbids (templated paths that
differ only in their names are identical); it still answers, deprecated, and
is left out of this document (runtime.http.app.DeprecatedSubmitRoute), so no
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

from runtime.errors import (
    BadRequest,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    QueueFull,
    RequestTimeout,
    ThawError,
    Unauthorized,
    Unavailable,
)
from runtime.version import __version__

PROBLEM = "application/problem+json"
_PARAM = re.compile(r"{([^}:]+)(?::[^}]+)?}")


def _ref(kind: str, name: str) -> dict[str, str]:
    return {"$ref": f"#/components/{kind}/{name}"}


def _problem(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "description": description,
        "headers": {**(headers or {}), "X-Request-Id": _ref("headers", "RequestId")},
        "content": {PROBLEM: {"schema": _ref("schemas", "Problem")}},
    }


def _json(
    schema: dict[str, Any],
    description: str,
    content_extra: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": schema}, **(content_extra or {})},
        **extra,
    }


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

_RETRY_AFTER = {"description": "Seconds to wait before retrying", "schema": {"type": "integer"}}

HEADERS: dict[str, Any] = {
    "RequestId": {
        "description": (
            "The request's id: the caller's X-Request-Id when it matches "
            "^[A-Za-z0-9._:-]{1,128}$, else a new one. Every log line about the "
            "request and its job names it (`request_id`)."
        ),
        "schema": {"type": "string", "minLength": 1},
        "required": True,
    },
    "VaryPrefer": {
        "description": "`Prefer`: the answer depends on it (RFC 7240 §2)",
        "schema": {"type": "string", "pattern": "Prefer"},
        "required": True,
    },
}

SCHEMAS: dict[str, Any] = {
    "Problem": {
        "type": "object",
        "description": "RFC 9457 problem details; `type` ends in the error's slug.",
        "required": ["type", "title", "status", "detail"],
        "properties": {
            "type": {"type": "string"},
            "title": {"type": "string"},
            "status": {"type": "integer"},
            "detail": {"type": "string"},
            "instance": {"type": "string"},
        },
        "additionalProperties": True,
    },
    "JobError": {
        "type": "object",
        "required": ["type", "message"],
        "properties": {
            "type": {"type": "string", "description": "the problem slug"},
            "message": {"type": "string"},
            "retryable": {"type": "boolean"},
        },
        "additionalProperties": True,
    },
    "Job": {
        "type": "object",
        "required": ["id", "handler", "status", "phase", "attempts", "created_at", "updated_at"],
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Za-z0-9_-]{22,}$"},
            "handler": {"type": "string"},
            "status": {
                "type": "string",
                "enum": ["queued", "running", "succeeded", "failed", "cancelled"],
            },
            "phase": {"type": "string"},
            "attempts": {"type": "integer", "minimum": 0},
            "created_at": {"type": "string", "format": "date-time"},
            "updated_at": {"type": "string", "format": "date-time"},
            "progress": {
                "type": "object",
                "description": (
                    "a load's bytes so far; a running generator handler's `items` so far "
                    "and `partial_output` (its items joined so far)"
                ),
            },
            "output": {"description": "the handler's output, once `succeeded`"},
            "error": _ref("schemas", "JobError"),
        },
    },
    "Model": {
        "type": "object",
        "required": ["name", "state", "loads", "hits"],
        "properties": {
            "name": {"type": "string"},
            "id": {"type": ["string", "null"], "description": "name@sha256:<manifest hash>"},
            "version": {"type": ["string", "null"]},
            "state": {"type": "string"},
            "bytes": {"type": ["integer", "null"]},
            "phase_ms": {"type": "object", "additionalProperties": {"type": "number"}},
            "loads": {"type": "integer"},
            "hits": {"type": "integer"},
            "in_flight": {"type": "integer"},
            "pinned": {"type": "boolean"},
            "last_used_at": {"type": ["number", "null"]},
            "error": {"type": ["object", "null"]},
            "progress": {"type": "object"},
            "estimate": {"type": "object"},
            "memory": {"type": "object"},
            "batching": {
                "type": "object",
                "description": "the handlers of this bundle that batch, by name, and their policy",
                "additionalProperties": {
                    "type": "object",
                    "required": ["max_size", "max_wait_ms", "max_concurrent"],
                    "properties": {
                        "max_size": {"type": "integer", "minimum": 1},
                        "max_wait_ms": {"type": "number", "minimum": 0},
                        "max_concurrent": {"type": "integer", "minimum": 1},
                    },
                },
            },
        },
    },
    "Models": {
        "type": "object",
        "required": ["models"],
        "properties": {
            "models": {"type": "array", "items": _ref("schemas", "Model")},
            "budget_bytes": {"type": ["integer", "null"]},
            "reserved_bytes": {"type": "integer"},
        },
    },
    "Status": {
        "type": "object",
        "required": ["status"],
        "properties": {
            "status": {"type": "string"},
            "waiting": {"type": "array", "items": {"type": "string"}},
        },
    },
}

PARAMETERS: dict[str, Any] = {
    "Prefer": {
        "name": "Prefer",
        "in": "header",
        "description": (
            "RFC 7240. `wait=<seconds>`: the caller's deadline (default THAW_WAIT_S): 200 "
            "if the work finishes by then, else 202 with a job. `respond-async`: 202 with "
            "a job at once. Both (`respond-async, wait=5`): 200 if the work can finish "
            "within the wait, else 202. Other preferences, and malformed ones, are "
            "ignored; a `wait` whose value is not a non-negative number of seconds is "
            "400 invalid-prefer. Every answer says `Vary: Prefer`."
        ),
        # Any value: unknown and malformed preferences are ignored, not refused. Only a
        # `wait` that is no non-negative number is refused (400 invalid-prefer), which
        # a pattern cannot say without look-arounds that generators do not support.
        "schema": {"type": "string", "maxLength": 1024},
        "examples": {
            "deadline": {"value": "wait=5"},
            "async": {"value": "respond-async"},
            "async unless quick": {"value": "respond-async, wait=5"},
        },
    },
    "RequestId": {
        "name": "X-Request-Id",
        "in": "header",
        "description": (
            "Used as the request id when it matches ^[A-Za-z0-9._:-]{1,128}$ (else "
            "ignored, and a new id given); answered as X-Request-Id."
        ),
        "schema": {"type": "string"},
    },
}

# One response per error class the contract names; the status comes from the class.
_ERRORS: dict[type[ThawError], tuple[str, str]] = {
    BadRequest: (
        "BadRequest",
        "invalid-json, invalid-prefer, invalid-input (names the field) or bad-request "
        "(e.g. nesting deeper than THAW_MAX_JSON_DEPTH)",
    ),
    Unauthorized: ("Unauthorized", "missing or wrong API key"),
    NotFound: ("NotFound", "unknown handler, bundle, job or route (a trailing slash is no route)"),
    MethodNotAllowed: (
        "MethodNotAllowed",
        "method-not-allowed: the path exists, not for this method; `Allow` and the "
        "problem's `allow` list the methods it serves",
    ),
    RequestTimeout: (
        "RequestTimeout",
        "request-timeout: the body did not arrive whole within THAW_BODY_TIMEOUT_S; "
        "the connection is closed",
    ),
    PayloadTooLarge: ("PayloadTooLarge", "body over THAW_MAX_BODY_BYTES"),
    QueueFull: ("QueueFull", "the handler's queue is full"),
    ThawError: (
        "InternalError",
        "handler-error, handler-timeout, invalid-output (output JSON cannot carry: not "
        "serialisable, or a NaN or infinite number), bundle-invalid, integrity or internal",
    ),
    Unavailable: (
        "Unavailable",
        "drained (the instance is draining, or stopped before the request finished; send it "
        "again), overloaded (request bodies buffered past THAW_MAX_BUFFERED_BYTES; the "
        "connection is closed), load-failed, insufficient-memory or storage-unavailable",
    ),
}


def _error_responses() -> dict[str, Any]:
    responses: dict[str, Any] = {}
    for cls, (name, description) in _ERRORS.items():
        headers: dict[str, Any] = {}
        if cls is Unauthorized:
            headers["WWW-Authenticate"] = {
                "description": 'Bearer realm="thaw"',
                "schema": {"type": "string"},
            }
        if cls is MethodNotAllowed:
            headers["Allow"] = {
                "description": "the methods the path serves",
                "schema": {"type": "string"},
                "required": True,
            }
        if cls in (QueueFull, Unavailable):
            headers["Retry-After"] = _RETRY_AFTER
        responses[name] = _problem(f"{cls.status}: {description}", headers)
    return responses


_JOB_HEADERS = {
    "Location": {"description": "/jobs/{id}", "schema": {"type": "string"}, "required": True},
    "Retry-After": _RETRY_AFTER,
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
_ACCEPTED = _json(
    _ref("schemas", "Job"), "a job; poll its Location", headers=_JOB_HEADERS, links=_JOB_LINKS
)
_VARY = {"Vary": _ref("headers", "VaryPrefer")}
_EVENT_BODY = {
    "required": False,
    "description": "the JSON event handed to the handler (an empty body is `{}`)",
    "content": {"application/json": {"schema": {}}},
}
_NAME = {"type": "string", "minLength": 1}


def _errors(*statuses: int) -> dict[str, Any]:
    by_status = {cls.status: name for cls, (name, _) in _ERRORS.items()}
    return {str(status): _ref("responses", by_status[status]) for status in statuses}


# Per endpoint: parameters (path parameters come from the route), body, responses.
OPERATIONS: dict[str, dict[str, Any]] = {
    "invoke": {
        "parameters": [_ref("parameters", "Prefer")],
        "requestBody": _EVENT_BODY,
        "responses": {
            "200": _json(
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
            **_errors(400, 404, 408, 413, 429, 500, 503),
        },
    },
    "submit_job": {
        "requestBody": _EVENT_BODY,
        "responses": {"202": _ACCEPTED, **_errors(400, 404, 408, 413, 429, 500, 503)},
    },
    "get_job": {
        "parameters": [
            {
                "name": "wait",
                "in": "query",
                "description": "long-poll up to this many seconds (at most 60) for a final state",
                "schema": {"type": "number", "minimum": 0},
            }
        ],
        "responses": {
            "200": _json(
                _ref("schemas", "Job"),
                "the job; with `Accept: text/event-stream`, its items so far and then as "
                "they come (after `Last-Event-ID`, when given), then its output or error",
                content_extra=_EVENT_STREAM,
            ),
            # 503: a long-poll the server's shutdown cut off (drained).
            **_errors(400, 404, 500, 503),
        },
    },
    "cancel_job": {
        "responses": {
            "200": _json(_ref("schemas", "Job"), "the job, cancelled unless already final"),
            **_errors(404, 500),
        },
    },
    "list_models": {
        "responses": {"200": _json(_ref("schemas", "Models"), "every bundle"), **_errors(500)},
    },
    "load_model": {
        "responses": {
            "202": _json(
                _ref("schemas", "Model"),
                "loading in the background",
                links={
                    "UnloadModel": {
                        "operationId": "unload_model",
                        "parameters": {"bundle": "$request.path.bundle"},
                        "description": "unload the bundle again",
                    }
                },
            ),
            **_errors(404, 500, 503),
        },
    },
    "unload_model": {
        "responses": {"200": _json(_ref("schemas", "Model"), "unloaded"), **_errors(404, 500)},
    },
    "healthz": {
        "security": [],
        "responses": {"200": _json(_ref("schemas", "Status"), "the process serves")},
    },
    "readyz": {
        "security": [],
        "responses": {
            "200": _json(_ref("schemas", "Status"), "ready"),
            "503": _json(_ref("schemas", "Status"), "warming or draining"),
        },
    },
    "drain": {
        "responses": {"202": _json(_ref("schemas", "Status"), "draining"), **_errors(500)},
    },
    "metrics": {
        "responses": {
            "200": {
                "description": "Prometheus text format",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            },
            **_errors(500),
        },
    },
    "openapi_document": {
        "responses": {"200": _json({"type": "object"}, "this document"), **_errors(500)},
    },
}


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
        responses.update(_errors(401))
    if not auth:
        fragment.pop("security", None)
    path_params = [
        {"name": p, "in": "path", "required": True, "schema": _NAME}
        for p in _PARAM.findall(route.path)
    ]
    for status, response in responses.items():
        if "$ref" not in response:  # the shared ones (errors) declare it themselves
            headers = {**response.get("headers", {}), "X-Request-Id": _ref("headers", "RequestId")}
            responses[status] = {**response, "headers": headers}
    parameters = [*path_params, *fragment.get("parameters", []), _ref("parameters", "RequestId")]
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
                "here, as OpenAPI 3.1 forbids it beside `/jobs/{job_id}`."
            ),
        },
        "paths": paths,
        "components": {
            "schemas": SCHEMAS,
            "parameters": PARAMETERS,
            "headers": HEADERS,
            "responses": _error_responses(),
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
