"""Streamed responses in the emulator: taken from a sandbox, handed on as they come.

A runtime that posts its response with `Lambda-Runtime-Function-Response-Mode:
streaming` (runtime/aws/streaming.py, or any custom runtime) sends a chunked
body, and reports a failure midway in the trailers
`Lambda-Runtime-Function-Error-Type` and `Lambda-Runtime-Function-Error-Body`
(base64 of the error object). The Runtime API listener (runtime_api.py)
answers the invocation at once with a `ResponseChunks` and feeds it each
chunk as it arrives; the caller reads it:

- InvokeWithResponseStream (eventstream.py): one PayloadChunk per chunk, then
  InvokeComplete (ErrorCode and ErrorDetails from the trailers);
- Invoke (RequestResponse): the chunks joined, as Lambda answers a plain
  invoke of a streaming function; the trailers' error as a function error;
- the Function URL: the prelude's status and headers, then the body as it comes.

The listener's server (http11.py) hands a request's trailers on in its scope's
headers, once its body has ended.

Imports nothing else of the emulator's (the Runtime API listener uses it).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

RESPONSE_MODE_HEADER = "lambda-runtime-function-response-mode"
ERROR_TYPE_TRAILER = "lambda-runtime-function-error-type"
ERROR_BODY_TRAILER = "lambda-runtime-function-error-body"
HTTP_INTEGRATION = "application/vnd.awslambda.http-integration-response"
PRELUDE_END = b"\0" * 8
# A Function URL looks for the prelude's end in the first 16 KiB of the stream.
MAX_PRELUDE_BYTES = 16 * 1024


class ResponseChunks:
    """A streamed response: chunks as the runtime sends them, then how it ended."""

    def __init__(self, content_type: str) -> None:
        self.content_type = content_type
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.error_type: str | None = None
        self.error_body: bytes = b""
        self.ended = False

    def write(self, chunk: bytes) -> None:
        if chunk and not self.ended:
            self._queue.put_nowait(chunk)

    def end(self, error_type: str | None = None, error_body: bytes = b"") -> None:
        """End it, once: a stream the pool cut (its timeout) ignores the runtime's
        own end (the connection its kill closed)."""
        if self.ended:
            return
        self.ended = True
        self.error_type, self.error_body = error_type, error_body
        self._queue.put_nowait(None)

    async def chunks(self) -> AsyncIterator[bytes]:
        """Each chunk once it arrives, until the end (one reader)."""
        while (chunk := await self._queue.get()) is not None:
            yield chunk

    async def read_all(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])


def is_streaming(request: Request) -> bool:
    return request.headers.get(RESPONSE_MODE_HEADER, "").lower() == "streaming"


async def receive(request: Request, sink: ResponseChunks) -> None:
    """Feed the request's chunked body to `sink`, then end it with the trailers' error."""
    try:
        async for chunk in request.stream():
            sink.write(chunk)
    except ClientDisconnect:
        sink.end("Runtime.TruncatedResponse", b"the runtime closed its response stream early")
        return
    trailers = Headers(scope=request.scope)  # read after the body: the trailers are in
    error_type = trailers.get(ERROR_TYPE_TRAILER)
    body = b""
    if error_type is not None:
        try:
            body = base64.b64decode(trailers.get(ERROR_BODY_TRAILER, ""), validate=True)
        except binascii.Error:
            body = trailers.get(ERROR_BODY_TRAILER, "").encode()
    sink.end(error_type, body)


def error_message(error_type: str, body: bytes) -> str:
    """The errorMessage of a trailer's error body (JSON), else the body as text."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace") or error_type
    if isinstance(payload, dict) and isinstance(payload.get("errorMessage"), str):
        return str(payload["errorMessage"])
    return body.decode("utf-8", "replace")


async def url_response(sink: ResponseChunks, headers: dict[str, str]) -> Response:
    """A streamed answer as its Function URL serves it (`headers`: the URL's own)."""
    chunks = sink.chunks()
    if sink.content_type.split(";")[0].strip() != HTTP_INTEGRATION:
        # No prelude: a 200 of the bytes as they are.
        return StreamingResponse(chunks, headers=headers, media_type=sink.content_type)
    head = b""
    async for chunk in chunks:
        head += chunk
        if PRELUDE_END in head or len(head) > MAX_PRELUDE_BYTES:
            break
    meta, found, rest = head.partition(PRELUDE_END)
    try:
        prelude: Any = orjson.loads(meta) if found else None
    except orjson.JSONDecodeError:
        prelude = None
    if not isinstance(prelude, dict) or not isinstance(prelude.get("statusCode", 200), int):
        return JSONResponse({"Message": "Internal Server Error"}, 502, headers=headers)

    async def body() -> AsyncIterator[bytes]:
        if rest:
            yield rest
        async for chunk in chunks:
            yield chunk

    response = StreamingResponse(body(), status_code=prelude.get("statusCode", 200))
    given = prelude.get("headers") or {}
    response.raw_headers.extend(
        (str(k).lower().encode("latin-1"), str(v).encode("utf-8")) for k, v in given.items()
    )
    response.raw_headers.extend(
        (b"set-cookie", str(c).encode("utf-8")) for c in prelude.get("cookies") or []
    )
    response.raw_headers.extend((k.encode("latin-1"), v.encode()) for k, v in headers.items())
    return response
