"""InvokeWithResponseStream, and the AWS event stream encoding its answer uses.

    POST /2021-11-15/functions/{name}/response-streaming-invocations
    -> 200 application/vnd.amazon.eventstream:
       PayloadChunk {Payload: bytes}      one per chunk the function streamed
       InvokeComplete {ErrorCode?, ErrorDetails?, LogResult?}   last

Each event is one binary message (the encoding botocore.eventstream decodes):

    total length u32 | headers length u32 | CRC32 of those 8 bytes
    headers: name length u8, name, value type u8 (7: string), value length u16, value
    payload
    CRC32 of everything before it

A function that answers without streaming (a 202's job object, an error before
anything was streamed) is one PayloadChunk of its payload; a function error is
InvokeComplete's ErrorCode (its errorType) and ErrorDetails (its message), as
Lambda reports one.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import zlib
from collections.abc import AsyncIterator

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from runtime.emulator.invocation import Outcome, Throttled
from runtime.emulator.invoke_api import _resolve, aws_error, read_payload
from runtime.emulator.pool import Pool
from runtime.emulator.streaming import error_message

MEDIA_TYPE = "application/vnd.amazon.eventstream"
_STRING = 7


def _header(name: str, value: str) -> bytes:
    raw_name, raw_value = name.encode(), value.encode()
    return (
        bytes([len(raw_name)])
        + raw_name
        + bytes([_STRING])
        + struct.pack(">H", len(raw_value))
        + raw_value
    )


def event_message(event_type: str, payload: bytes, content_type: str) -> bytes:
    """One event of an AWS event stream, CRCs and all."""
    headers = (
        _header(":event-type", event_type)
        + _header(":content-type", content_type)
        + _header(":message-type", "event")
    )
    prelude = struct.pack(">II", 12 + len(headers) + len(payload) + 4, len(headers))
    message = prelude + struct.pack(">I", zlib.crc32(prelude)) + headers + payload
    return message + struct.pack(">I", zlib.crc32(message))


def payload_chunk(payload: bytes) -> bytes:
    return event_message("PayloadChunk", payload, "application/octet-stream")


def invoke_complete(
    error_code: str | None = None, details: str | None = None, log_result: str | None = None
) -> bytes:
    body: dict[str, str] = {}
    if error_code is not None:
        body["ErrorCode"] = error_code
        body["ErrorDetails"] = details or error_code
    if log_result is not None:
        body["LogResult"] = log_result
    return event_message("InvokeComplete", orjson.dumps(body), "application/json")


async def _events(outcome: Outcome, tail: bool) -> AsyncIterator[bytes]:
    sink = outcome.stream
    if sink is None:
        if outcome.payload:
            yield payload_chunk(outcome.payload)
        error_type = outcome.error_type
        details = error_message(error_type, outcome.payload) if error_type else None
    else:
        async for chunk in sink.chunks():
            yield payload_chunk(chunk)
        error_type = sink.error_type
        details = error_message(error_type, sink.error_body) if error_type else None
    log_result = None
    if tail:
        finished = await asyncio.shield(outcome.finished)
        log_result = base64.b64encode(finished.log_tail()).decode("ascii")
    yield invoke_complete(error_type, details, log_result)


async def invoke_with_response_stream(request: Request) -> Response:
    pool: Pool = request.app.state.pool
    resolved = _resolve(request)
    if isinstance(resolved, Response):
        return resolved
    function, qualifier, version = resolved
    read = await read_payload(request, "InvokeWithResponseStream")
    if isinstance(read, Response):
        return read
    body, client_context = read
    try:
        outcome = await pool.invoke(
            function, body, client_context=client_context, version=version, qualifier=qualifier
        )
    except Throttled as exc:
        return aws_error(429, "TooManyRequestsException", "Rate Exceeded.", Reason=exc.reason)
    headers = {"X-Amz-Executed-Version": version, "x-amzn-RequestId": outcome.request_id}
    tail = request.headers.get("x-amz-log-type") == "Tail"
    return StreamingResponse(_events(outcome, tail), headers=headers, media_type=MEDIA_TYPE)


routes = [
    Route(
        "/2021-11-15/functions/{name}/response-streaming-invocations",
        invoke_with_response_stream,
        methods=["POST"],
    )
]
