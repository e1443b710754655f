"""The OpenAI-compatible routes: `/v1/embeddings`, `/v1/chat/completions`,
`/v1/completions`, `/v1/models` (docs/openai.md).

Each request is translated (runtime/http/openai/requests.py) into an invocation
of the handler its `model` names and runs as every invocation runs, through
`Instance.invoke`: an embeddings request joins the handler's batches, a chat
request its decode steps. Its errors are OpenAI's error body
(runtime/http/problems.py renders every answer under /v1/ so).

The caller's deadline is the smallest of the timeout the official clients
declare (`X-Stainless-Timeout`, or `X-Stainless-Read-Timeout` as the Python
client sends it: each attempt's own), a `Prefer: wait` (the Lambda loop's
deadline) and THAW_MAX_WAIT_S; THAW_WAIT_S without one. These clients cannot
take a 202, so the invocation's policy is `RETRY_LATER`
(runtime/dispatch/warming.py): where the deadline rule would make a job, the
answer is 503 `warming-up` with `Retry-After` and `retry-after-ms`, which the
clients wait out and retry by themselves while the load goes on.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from runtime.dispatch.answers import RETRY_LATER, STREAM_OR_RETRY, Answer
from runtime.dispatch.streams import Stream
from runtime.errors import BadRequest, ThawError, UnknownHandler
from runtime.http import sse
from runtime.http.auth import key_id_of
from runtime.http.edge import request_id_of
from runtime.http.holds import Holds
from runtime.http.intake import Intake, parse_json
from runtime.http.openai import requests
from runtime.http.openai.answers import Completion, embeddings_body
from runtime.http.prefer import parse_prefer
from runtime.http.problems import openai_error
from runtime.http.responses import JSONResponse, server_timing
from runtime.instance import Instance
from runtime.registry import Registry
from runtime.settings import Settings
from runtime.wire.outputs import encode_output

log = logging.getLogger("thaw.app")

# The timeouts the official clients send with each attempt, in seconds.
TIMEOUT_HEADERS = ("x-stainless-timeout", "x-stainless-read-timeout")
_OPERATIONS = ("chat", "completions", "embeddings")


def caller_wait_s(request: Request, settings: Settings) -> float:
    """The seconds this attempt may take (see the module doc)."""
    waits: list[float] = []
    for header in TIMEOUT_HEADERS:
        value = request.headers.get(header)
        if value is None:
            continue
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if not math.isfinite(seconds) or seconds < 0:
            raise BadRequest(f"{header}: {value!r} is not a number of seconds", field=header)
        waits.append(seconds)
    prefer = parse_prefer(request.headers.getlist("prefer")).wait_s
    if prefer is not None:
        waits.append(prefer)
    return min(min(waits) if waits else settings.wait_s, settings.max_wait_s)


async def _call(
    request: Request, parse: Callable[[Registry, Any], requests.Call]
) -> tuple[requests.Call, float]:
    state = request.app.state
    instance: Instance = state.instance
    intake: Intake = state.intake
    settings = instance.settings
    raw = await intake.read(request, settings.max_body_bytes)
    try:
        call = parse(instance.registry, parse_json(raw, settings.max_json_depth))
    finally:
        intake.release(len(raw))
    return call, caller_wait_s(request, settings)


async def _completed(request: Request, call: requests.Call, wait_s: float) -> Answer:
    """The handler's output, or (past the deadline) WarmingUp: never a job."""
    instance: Instance = request.app.state.instance
    return await instance.invoke(
        call.spec.name,
        call.event,
        wait_s=wait_s,
        policy=RETRY_LATER,
        request_id=request_id_of(request),
        key_id=key_id_of(request),
    )


def _json(handler: str, body: Any, outcome: Answer) -> Response:
    timing = server_timing(outcome.timings_ms, outcome.batch_size)
    return Response(
        encode_output(handler, body),
        media_type="application/json",
        headers={"Server-Timing": timing},
    )


async def create_embeddings(request: Request) -> Response:
    """Embed texts (OpenAI `POST /v1/embeddings`) with a handler serving embeddings."""
    call, wait_s = await _call(request, requests.embeddings)
    outcome = await _completed(request, call, wait_s)
    body = embeddings_body(call.spec.name, call.model, outcome.output, call.encoding)
    return _json(call.spec.name, body, outcome)


async def create_chat_completion(request: Request) -> Response | sse.EventStreamResponse:
    """Complete a chat (OpenAI `POST /v1/chat/completions`), whole or streamed."""
    call, wait_s = await _call(request, requests.chat)
    return await _complete(request, call, wait_s, chat=True)


async def create_completion(request: Request) -> Response | sse.EventStreamResponse:
    """Complete a prompt (OpenAI `POST /v1/completions`), whole or streamed."""
    call, wait_s = await _call(request, requests.completion)
    return await _complete(request, call, wait_s, chat=False)


async def _complete(
    request: Request, call: requests.Call, wait_s: float, *, chat: bool
) -> Response | sse.EventStreamResponse:
    answer = Completion(chat, call.spec.name, call.model, request_id_of(request))
    if not call.stream:
        outcome = await _completed(request, call, wait_s)
        return _json(call.spec.name, answer.body(outcome.output), outcome)
    instance: Instance = request.app.state.instance
    holds: Holds = request.app.state.holds
    key_id = key_id_of(request)
    # A stream holds its connection (runtime/http/holds.py), as /invoke's do.
    holds.take(key_id)
    try:
        streaming = await instance.invoke(
            call.spec.name,
            call.event,
            wait_s=wait_s,
            policy=STREAM_OR_RETRY,
            request_id=request_id_of(request),
            key_id=key_id,
        )
        stream = streaming.stream
        assert stream is not None  # its stream, or (past the deadline) WarmingUp
        heartbeat_s = instance.settings.sse_heartbeat_s
        # Headers wait for the first item, so input the handler refuses is a 400.
        await stream.wait_change(0, heartbeat_s)
        if stream.ended and stream.error is not None and not stream.items:
            raise stream.error
        return sse.EventStreamResponse(
            _chunks(stream, answer, call.include_usage, heartbeat_s),
            on_disconnect=stream.close,
            headers={"Server-Timing": server_timing(streaming.timings_ms)},
            on_end=lambda: holds.give(key_id),
        )
    except BaseException:
        holds.give(key_id)
        raise


async def _chunks(
    stream: Stream, answer: Completion, usage: bool, heartbeat_s: float
) -> AsyncIterator[bytes]:
    """The stream's items as OpenAI chunks, heartbeats in the gaps, then its end."""
    try:
        if first := answer.first_chunk(usage):
            yield first
        async for batch in stream.follow(0, heartbeat_s):
            if not batch:
                yield sse.HEARTBEAT
                continue
            yield b"".join(answer.item_chunk(item, usage) for item in batch)
        if stream.error is not None:
            raise stream.error
        yield answer.last_chunks(stream.result, usage)
    except ThawError as exc:
        stream.close()
        # Midway, an error is a chunk of its own: the official clients raise it.
        yield sse.data_event(openai_error(exc))
    except Exception as exc:
        log.exception("OpenAI stream of %s failed", answer.handler)
        stream.close()
        yield sse.data_event(openai_error(ThawError(f"internal error: {type(exc).__name__}")))


def _model(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "thaw"}


def _model_names(registry: Registry) -> list[str]:
    names = [name for op in _OPERATIONS for name, _spec in requests.serving(registry, op)]
    return list(dict.fromkeys(names))


async def list_openai_models(request: Request) -> Response:
    """Every model the OpenAI routes answer to (OpenAI `GET /v1/models`)."""
    instance: Instance = request.app.state.instance
    models = [_model(name) for name in _model_names(instance.registry)]
    return JSONResponse({"object": "list", "data": models})


async def get_openai_model(request: Request) -> Response:
    """One model the OpenAI routes answer to (OpenAI `GET /v1/models/{model}`)."""
    instance: Instance = request.app.state.instance
    name = request.path_params["model"]
    if name not in _model_names(instance.registry):
        raise UnknownHandler(
            f"the model {name!r} does not exist (see GET /v1/models)", field="model"
        )
    return JSONResponse(_model(name))
