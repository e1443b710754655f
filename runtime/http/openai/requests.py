"""OpenAI request bodies as handler events (runtime/wire/openai_spec.py says each shape).

Every parameter a route takes is either passed on to the handler, or is a
no-op at the value given (`n: 1`,
`frequency_penalty: 0`, ...); any other parameter, or another value of a
no-op one, is refused with a 400 naming it (`code: unsupported_parameter`). A
`null` is OpenAI's "not given". `model` names a handler that declares the
operation, by its name or an alias; any other is a 404 (`model_not_found`).

What is passed on is first held to OpenAI's own bounds (`BOUNDS`: the ones the
OpenAPI document states, so every handler refuses the same out-of-range value
the same way); the handler then applies its own, tighter ones (a model's
context, its stop strings), each a 400 naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runtime.errors import InvalidInput, UnknownHandler
from runtime.registry import HandlerSpec, Registry

# Passed on to the handler as they are (its own checks name what is out of range).
_SAMPLING = ("temperature", "top_p", "seed")
# Parameters whose one value here is OpenAI's default: taken, and nothing to do.
_NO_OPS: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "logprobs": (False,),
    "best_of": (1,),
    "echo": (False,),
    "response_format": ({"type": "text"},),
    "user": (),  # any string: the caller's own label, which Thaw has no use for
}
_CHAT = frozenset(
    {"model", "messages", "max_tokens", "max_completion_tokens", "stop", "stream"}
    | {"stream_options", *_SAMPLING, "n", "frequency_penalty", "presence_penalty"}
    | {"logprobs", "response_format", "user"}
)
_COMPLETIONS = frozenset(
    {"model", "prompt", "max_tokens", "stop", "stream", "stream_options", *_SAMPLING}
    | {"n", "frequency_penalty", "presence_penalty", "logprobs", "best_of", "echo", "user"}
)
_EMBEDDINGS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})
# Chat roles a handler's event names; OpenAI's `developer` is the newer `system`.
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
ENCODINGS = ("float", "base64")
# OpenAI's documented range of each number passed on (None: unbounded that way).
BOUNDS: dict[str, tuple[type, float | None, float | None]] = {
    "temperature": (float, 0.0, 2.0),
    "top_p": (float, 0.0, 1.0),
    "seed": (int, None, None),
    "max_tokens": (int, 1, None),
    "max_completion_tokens": (int, 1, None),
}
MAX_STOP = 4
MAX_INPUTS = 2048  # texts in one embeddings request, as OpenAI allows


def unsupported(param: str, why: str) -> InvalidInput:
    return InvalidInput(param, why, code="unsupported_parameter")


@dataclass(frozen=True)
class Call:
    """One OpenAI request as an invocation: the handler, its event, how to answer."""

    spec: HandlerSpec
    model: str
    event: dict[str, Any]
    stream: bool = False
    include_usage: bool = False
    encoding: str = "float"


def serving(registry: Registry, operation: str) -> list[tuple[str, HandlerSpec]]:
    """Every model name (handler names, then aliases) of the handlers serving `operation`."""
    names: list[tuple[str, HandlerSpec]] = []
    for spec in registry.handlers.values():
        if spec.openai is not None and operation in spec.openai.operations:
            names += [(name, spec) for name in (spec.name, *spec.openai.aliases)]
    return names


def resolve(registry: Registry, operation: str, model: Any) -> HandlerSpec:
    """The handler `model` names for `operation`: UnknownHandler (404) if none does."""
    if not isinstance(model, str) or not model:
        raise InvalidInput("model", "must be a non-empty string naming a model (GET /v1/models)")
    for name, spec in serving(registry, operation):
        if name == model:
            return spec
    raise UnknownHandler(
        f"the model {model!r} does not exist or does not serve {operation} (see GET /v1/models)",
        field="model",
    )


def _given(body: Any, allowed: frozenset[str]) -> dict[str, Any]:
    """The body's parameters that are given (not null), each one Thaw takes."""
    if not isinstance(body, Mapping):
        raise InvalidInput("body", "must be a JSON object")
    fields = {key: value for key, value in body.items() if value is not None}
    for key, value in fields.items():
        if key not in allowed:
            raise unsupported(str(key), "is not supported by this server")
        if key in _NO_OPS and _NO_OPS[key] and value not in _NO_OPS[key]:
            shown = ", ".join(repr(v) for v in _NO_OPS[key][:1])
            raise unsupported(key, f"must be {shown} here (got {value!r})")
        if key == "user" and not isinstance(value, str):
            raise InvalidInput("user", "must be a string")
    if "model" not in fields:
        raise InvalidInput("model", "is required")
    return fields


def _streaming(fields: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = fields.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidInput("stream", "must be a boolean")
    options = fields.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise InvalidInput("stream_options", "is only allowed with stream: true")
    if not isinstance(options, Mapping):
        raise InvalidInput("stream_options", "must be an object")
    for key in options:
        if key != "include_usage":
            raise unsupported(f"stream_options.{key}", "is not supported by this server")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise InvalidInput("stream_options.include_usage", "must be a boolean")
    return stream, include


def _bounded(name: str, value: Any) -> None:
    kind, low, high = BOUNDS[name]
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or (kind is int and not isinstance(value, int)) or math.isnan(value):
        raise InvalidInput(name, "must be an integer" if kind is int else "must be a number")
    if (low is not None and value < low) or (high is not None and value > high):
        span = f"from {low:g}" if high is None else f"from {low:g} to {high:g}"
        raise InvalidInput(name, f"must be {span} (got {value!r})")


def _stop(value: Any) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not 1 <= len(stops) <= MAX_STOP:
        raise InvalidInput("stop", f"must be a string or a list of 1 to {MAX_STOP} strings")
    if not all(isinstance(s, str) for s in stops):
        raise InvalidInput("stop", "must hold strings only")
    return stops


def _generation(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling parameters of a chat or completion, as the handler's event has them."""
    for name in BOUNDS:
        if name in fields:
            _bounded(name, fields[name])
    event = {key: fields[key] for key in _SAMPLING if key in fields}
    limits = [fields[k] for k in ("max_tokens", "max_completion_tokens") if k in fields]
    if len(limits) == 2 and limits[0] != limits[1]:
        raise InvalidInput("max_completion_tokens", "differs from max_tokens: give one")
    if limits:
        event["max_tokens"] = limits[0]
    if "stop" in fields:
        event["stop"] = _stop(fields["stop"])
    return event


def _content(value: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InvalidInput(where, "must be a string or a list of text parts")
    texts: list[str] = []
    for i, part in enumerate(value):
        if not isinstance(part, Mapping) or part.get("type") != "text":
            raise unsupported(f"{where}[{i}]", "only text parts are supported by this server")
        if set(part) != {"type", "text"} or not isinstance(part["text"], str):
            raise InvalidInput(f"{where}[{i}]", "a text part is {type: text, text: string}")
        texts.append(part["text"])
    return "".join(texts)


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise InvalidInput("messages", "must be a non-empty list of messages")
    messages: list[dict[str, str]] = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise InvalidInput(where, "must be an object with role and content")
        for key in message:
            if key not in ("role", "content"):
                raise unsupported(f"{where}.{key}", "is not supported by this server")
        role = message.get("role")
        if role not in _ROLES:
            raise unsupported(f"{where}.role", f"must be one of {', '.join(_ROLES)}")
        if "content" not in message:
            raise InvalidInput(f"{where}.content", "is required")
        messages.append(
            {"role": _ROLES[role], "content": _content(message["content"], f"{where}.content")}
        )
    return messages


def chat(registry: Registry, body: Any) -> Call:
    """`POST /v1/chat/completions`."""
    fields = _given(body, _CHAT)
    spec = resolve(registry, "chat", fields["model"])
    if "messages" not in fields:
        raise InvalidInput("messages", "is required")
    stream, include_usage = _streaming(fields)
    event = {"messages": _messages(fields["messages"]), **_generation(fields)}
    return Call(spec, fields["model"], event, stream, include_usage)


def completion(registry: Registry, body: Any) -> Call:
    """`POST /v1/completions`."""
    fields = _given(body, _COMPLETIONS)
    spec = resolve(registry, "completions", fields["model"])
    prompt = fields.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise unsupported("prompt", "must be one string here (a list asks for several answers)")
    if not isinstance(prompt, str):
        raise InvalidInput("prompt", "is required: a string")
    stream, include_usage = _streaming(fields)
    event = {"prompt": prompt, **_generation(fields)}
    return Call(spec, fields["model"], event, stream, include_usage)


def embeddings(registry: Registry, body: Any) -> Call:
    """`POST /v1/embeddings`."""
    fields = _given(body, _EMBEDDINGS)
    spec = resolve(registry, "embeddings", fields["model"])
    assert spec.openai is not None
    given = fields.get("input")
    texts = [given] if isinstance(given, str) else given
    if not isinstance(texts, list) or not texts:
        raise InvalidInput("input", "is required: a string or a non-empty list of strings")
    if len(texts) > MAX_INPUTS:
        raise InvalidInput("input", f"holds {len(texts)} texts; the limit is {MAX_INPUTS}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            # Token arrays are OpenAI's too, but a token is a model's own: refused.
            raise unsupported(f"input[{i}]", "must be a string (token arrays are not supported)")
    encoding = fields.get("encoding_format", "float")
    if encoding not in ENCODINGS:
        raise InvalidInput("encoding_format", f"must be one of {', '.join(ENCODINGS)}")
    if "dimensions" in fields and fields["dimensions"] != spec.openai.dimensions:
        dims = spec.openai.dimensions
        why = f"must be {dims}, the model's own" if dims else "cannot be chosen for this model"
        raise unsupported("dimensions", why)
    return Call(spec, fields["model"], {"texts": texts}, encoding=encoding)
