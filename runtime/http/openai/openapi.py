"""The OpenAPI description of the /v1 routes: their operations (merged into
runtime/http/openapi.py's OPERATIONS), the schemas they use, and their error
responses, which are OpenAI's error body rather than problem+json."""

from __future__ import annotations

from typing import Any

from runtime.http.openai.requests import MAX_INPUTS, MAX_STOP

_ERROR = {"$ref": "#/components/schemas/OpenAIError"}
_REQUEST_ID = {"$ref": "#/components/headers/RequestId"}
_RETRY = {
    "Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}},
    "retry-after-ms": {"description": "milliseconds to wait", "schema": {"type": "integer"}},
}
_WHY = {
    400: "a parameter refused (`param` names it; `code` unsupported_parameter for one Thaw "
    "does not honour)",
    401: "missing or wrong API key (`Authorization: Bearer`)",
    404: "no such model for this operation (`code` model_not_found), or no route",
    408: "the body did not arrive in time",
    413: "body over THAW_MAX_BODY_BYTES",
    429: "the handler's queue is full, or the key holds all the connections it may",
    500: "the handler failed",
    503: "warming-up: not ready within the caller's timeout; the load goes on, retry after "
    "`retry-after-ms` (the official clients do); or draining, overloaded",
}


def openai_errors(*statuses: int) -> dict[str, Any]:
    """Error responses in OpenAI's shape for `statuses`."""
    out: dict[str, Any] = {}
    for status in statuses:
        headers: dict[str, Any] = {"X-Request-Id": _REQUEST_ID}
        if status in (429, 503):
            headers.update(_RETRY)
        out[str(status)] = {
            "description": _WHY[status],
            "headers": headers,
            "content": {"application/json": {"schema": _ERROR}},
        }
    return out


_STRINGS = {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": MAX_STOP}
_STOP = {"oneOf": [{"type": "string"}, _STRINGS, {"type": "null"}]}
_INT = {"type": ["integer", "null"]}
# OpenAI's own bounds, which every handler is held to (requests.BOUNDS); a handler's
# tighter ones (a model's context) are its own 400s.
_TOKENS = {"type": ["integer", "null"], "minimum": 1, "description": "at most the handler's own"}
_ZERO = {"enum": [0, None]}
_STREAM_OPTIONS = {
    "type": ["object", "null"],
    "properties": {"include_usage": {"type": "boolean"}},
    "additionalProperties": False,
    "description": "only with `stream: true`",
}
_MODEL = {"type": "string", "minLength": 1, "description": "a handler or its alias: GET /v1/models"}
_GENERATION = {
    "model": _MODEL,
    "max_tokens": _TOKENS,
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "top_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
    "seed": _INT,
    "stop": _STOP,
    "n": {"enum": [1, None], "description": "one choice only"},
    "stream": {"type": ["boolean", "null"]},
    "stream_options": _STREAM_OPTIONS,
    "frequency_penalty": _ZERO,
    "presence_penalty": _ZERO,
    "logprobs": {"enum": [False, None]},
    "user": {"type": ["string", "null"]},
}
_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "additionalProperties": False,
}
_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]},
    },
    "additionalProperties": False,
}

SCHEMAS: dict[str, Any] = {
    "OpenAIError": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    },
    "ChatRequest": {
        "type": "object",
        "required": ["model", "messages"],
        "properties": {
            **_GENERATION,
            "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
            "max_completion_tokens": _TOKENS,
            "response_format": {
                "oneOf": [
                    {
                        "type": "object",
                        "required": ["type"],
                        "properties": {"type": {"const": "text"}},
                        "additionalProperties": False,
                    },
                    {"type": "null"},
                ]
            },
        },
        "additionalProperties": False,
    },
    "CompletionRequest": {
        "type": "object",
        "required": ["model", "prompt"],
        "properties": {
            **_GENERATION,
            "prompt": {
                "oneOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1},
                ]
            },
            "best_of": {"enum": [1, None]},
            "echo": {"enum": [False, None]},
        },
        "additionalProperties": False,
    },
    "EmbeddingRequest": {
        "type": "object",
        "required": ["model", "input"],
        "properties": {
            "model": _MODEL,
            "input": {"oneOf": [{"type": "string"}, _STRINGS | {"maxItems": MAX_INPUTS}]},
            "encoding_format": {"enum": ["float", "base64", None]},
            "dimensions": {
                "type": ["integer", "null"],
                "description": "only the model's own (an embeddings handler's OpenAI declaration)",
            },
            "user": {"type": ["string", "null"]},
        },
        "additionalProperties": False,
    },
    "OpenAIModel": {
        "type": "object",
        "required": ["id", "object", "created", "owned_by"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
        },
    },
}

_TIMEOUTS = [
    {
        "name": name,
        "in": "header",
        "description": (
            "seconds this attempt may take (the official clients send it): the deadline, "
            "with `Prefer: wait` and THAW_MAX_WAIT_S; THAW_WAIT_S without any"
        ),
        "schema": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
    }
    for name in ("X-Stainless-Timeout", "X-Stainless-Read-Timeout")
]
# Before OpenAPI 3.2, an event stream's `schema` is each event's.
_EVENTS = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "required": ["data"],
            "properties": {"event": {"const": "message"}, "data": {"type": "string"}},
            "description": "with `stream: true`: `data: <chunk JSON>` events, then `data: [DONE]`",
        }
    }
}


# What a user sends to the shipped handlers (handlers/embed.py, handlers/generate.py).
_EXAMPLES: dict[str, dict[str, Any]] = {
    "EmbeddingRequest": {
        "one text": {"value": {"model": "embed", "input": "A man is eating food."}},
        "base64": {
            "value": {"model": "all-MiniLM-L6-v2", "input": ["a", "b"], "encoding_format": "base64"}
        },
    },
    "ChatRequest": {
        "chat": {
            "value": {
                "model": "generate",
                "messages": [{"role": "user", "content": "Say hi."}],
                "max_completion_tokens": 8,
            }
        },
        "streamed with usage": {
            "value": {
                "model": "generate",
                "messages": [{"role": "user", "content": "Say hi."}],
                "max_tokens": 8,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        },
    },
    "CompletionRequest": {
        "prompt": {
            "value": {"model": "generate", "prompt": "Once upon a time", "max_tokens": 8, "seed": 1}
        },
    },
}


def _post(schema: str, answer: str, streams: bool) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if streams:
        content |= _EVENTS
    body = {"schema": {"$ref": f"#/components/schemas/{schema}"}, "examples": _EXAMPLES[schema]}
    return {
        "parameters": _TIMEOUTS,
        "requestBody": {"required": True, "content": {"application/json": body}},
        "responses": {
            "200": {"description": answer, "content": content},
            **openai_errors(400, 404, 408, 413, 429, 500, 503),
        },
    }


OPERATIONS: dict[str, dict[str, Any]] = {
    "create_embeddings": _post("EmbeddingRequest", "OpenAI's embeddings list", False),
    "create_chat_completion": _post("ChatRequest", "OpenAI's chat.completion", True),
    "create_completion": _post("CompletionRequest", "OpenAI's text_completion", True),
    "list_openai_models": {
        "responses": {
            "200": {
                "description": "every model name the /v1 routes answer to",
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "required": ["object", "data"],
                            "properties": {
                                "object": {"const": "list"},
                                "data": {
                                    "type": "array",
                                    "items": {"$ref": "#/components/schemas/OpenAIModel"},
                                },
                            },
                        }
                    }
                },
            },
            **openai_errors(500),
        }
    },
    "get_openai_model": {
        "responses": {
            "200": {
                "description": "the model",
                "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/OpenAIModel"}}
                },
            },
            **openai_errors(404, 500),
        }
    },
}
