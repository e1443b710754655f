"""The OpenAPI components of the HTTP contract: the schemas, parameters and headers
the document refers to, one response per error class the contract names, and
the small constructors of response objects the operations use
(runtime/http/openapi.py builds the document from them and the route table).
"""

from __future__ import annotations

from typing import Any

from runtime.errors import (
    BadRequest,
    Forbidden,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    QueueFull,
    RequestTimeout,
    ThawError,
    Unauthorized,
    Unavailable,
)
from runtime.http.problems import PROBLEM


def ref(kind: str, name: str) -> dict[str, str]:
    """A reference to `#/components/<kind>/<name>`."""
    return {"$ref": f"#/components/{kind}/{name}"}


def _problem(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "description": description,
        "headers": {**(headers or {}), "X-Request-Id": ref("headers", "RequestId")},
        "content": {PROBLEM: {"schema": ref("schemas", "Problem")}},
    }


def json_response(
    schema: dict[str, Any],
    description: str,
    content_extra: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A response object whose JSON body follows `schema` (plus `content_extra` types)."""
    return {
        "description": description,
        "content": {"application/json": {"schema": schema}, **(content_extra or {})},
        **extra,
    }


RETRY_AFTER = {"description": "Seconds to wait before retrying", "schema": {"type": "integer"}}

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

# Handler modules that failed to import (runtime/registry/broken.py): their
# handlers are not served; the instance serves the rest and stays ready.
BROKEN: dict[str, Any] = {"type": "array", "items": ref("schemas", "BrokenModule")}

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
            "error": ref("schemas", "JobError"),
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
            "weights_read": {
                "type": ["string", "null"],
                "enum": ["copied", "mapped", "device", None],
                "description": (
                    "how the last load read the weights: copied out of the files, mapped "
                    "from a read-only filesystem for the build (what the model keeps is "
                    "copied out after it), or read by the device's own path"
                ),
            },
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
            "models": {"type": "array", "items": ref("schemas", "Model")},
            "budget_bytes": {"type": ["integer", "null"]},
            "reserved_bytes": {"type": "integer"},
            "broken_modules": BROKEN,
        },
    },
    "Status": {
        "type": "object",
        "required": ["status"],
        "properties": {
            "status": {"type": "string"},
            "waiting": {"type": "array", "items": {"type": "string"}},
            "broken_modules": BROKEN,
        },
    },
    "BrokenModule": {
        "type": "object",
        "required": ["module"],
        "description": "module (and in /models its handlers); file, line, error for operators",
        "properties": {
            "module": {"type": "string"},
            "file": {"type": ["string", "null"]},
            "line": {"type": ["integer", "null"]},
            "error": {"type": "string"},
            "handlers": {"type": "array", "items": {"type": "string"}},
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
    Forbidden: ("Forbidden", "forbidden: an instance-wide action, which needs an operator key"),
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
    QueueFull: (
        "QueueFull",
        "queue-full: the handler's queue is full; quota-exceeded: the key holds all the "
        "connections or stored jobs it may",
    ),
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


def error_responses() -> dict[str, Any]:
    """`components/responses`: one problem response per error class, named as `_ERRORS` says."""
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
            headers["Retry-After"] = RETRY_AFTER
        responses[name] = _problem(f"{cls.status}: {description}", headers)
    return responses


def errors(*statuses: int) -> dict[str, Any]:
    """An operation's error responses for `statuses`, as references to the shared ones."""
    by_status = {cls.status: name for cls, (name, _) in _ERRORS.items()}
    return {str(status): ref("responses", by_status[status]) for status in statuses}
