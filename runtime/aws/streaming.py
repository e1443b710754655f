"""Lambda response streaming: answers posted to the Runtime API as they are made.

    POST /2018-06-01/runtime/invocation/{id}/response
    Lambda-Runtime-Function-Response-Mode: streaming
    Transfer-Encoding: chunked
    Trailer: Lambda-Runtime-Function-Error-Type, Lambda-Runtime-Function-Error-Body

    <chunk> <chunk> ... 0
    [Lambda-Runtime-Function-Error-Type: <errorType>]           a failure once streaming,
    [Lambda-Runtime-Function-Error-Body: <base64 of the error>]  reported as trailers

(docs.aws.amazon.com/lambda/latest/dg/runtimes-custom.html, "Implementing
response streaming in a custom runtime"). httpx sends no trailers, so the post
is written here, on a connection of its own.

Two kinds of invocation stream:

- a Function URL event, when the URL's invoke mode is RESPONSE_STREAM
  (THAW_INVOKE_MODE, set by template.yaml): the app's answer as a Function URL
  streams it (docs .../config-rs-invoke-furls.html): content type
  `application/vnd.awslambda.http-integration-response`, a JSON prelude
  `{"statusCode", "headers", "cookies"}`, eight NUL bytes, then the body as
  the app sends it (an event stream's events, each as it leaves);
- a direct event with `"stream": true` (InvokeWithResponseStream):
  newline-delimited JSON, one line per item, then `{"output": <joined>}`; a
  failure midway is the error trailers (the caller's InvokeComplete
  ErrorCode and ErrorDetails).

If Lambda closes the post (the caller went away), writing fails and the
stream's work is cancelled, as for an HTTP client that disconnects.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import orjson
from starlette.types import ASGIApp, Message

from runtime.aws.events import HttpRequest
from runtime.dispatch.answers import STREAM
from runtime.errors import InvalidEvent, ThawError
from runtime.wire.outputs import JSON_OPTIONS, encode_output
from runtime.wire.render import LambdaError, lambda_error

if TYPE_CHECKING:
    from runtime.instance import Instance

log = logging.getLogger("thaw.lambda")

HTTP_INTEGRATION = "application/vnd.awslambda.http-integration-response"
NDJSON = "application/x-ndjson"
PRELUDE_END = b"\0" * 8
ERROR_TYPE_TRAILER = "Lambda-Runtime-Function-Error-Type"
ERROR_BODY_TRAILER = "Lambda-Runtime-Function-Error-Body"


class StreamedPost:
    """One streamed response post to the Runtime API at `address` (host:port)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self.finished = False

    @classmethod
    async def open(cls, address: str, request_id: str, content_type: str) -> StreamedPost:
        host, _, port = address.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        head = (
            f"POST /2018-06-01/runtime/invocation/{request_id}/response HTTP/1.1\r\n"
            f"Host: {address}\r\n"
            "Lambda-Runtime-Function-Response-Mode: streaming\r\n"
            "Transfer-Encoding: chunked\r\n"
            f"Trailer: {ERROR_TYPE_TRAILER}, {ERROR_BODY_TRAILER}\r\n"
            f"Content-Type: {content_type}\r\n\r\n"
        )
        writer.write(head.encode("latin-1"))
        return cls(reader, writer)

    async def write(self, data: bytes) -> None:
        """Send `data` as one chunk, now; raises OSError once Lambda closed the stream."""
        if not data:
            return  # an empty chunk would end the body
        self._writer.write(b"%x\r\n%b\r\n" % (len(data), data))
        await self._writer.drain()

    async def finish(self, error: LambdaError | None = None) -> int:
        """End the body, with the error trailers if `error`; the Runtime API's status."""
        self.finished = True
        trailers = b""
        if error is not None:
            body = base64.b64encode(orjson.dumps(error)).decode("ascii")
            trailers = (
                f"{ERROR_TYPE_TRAILER}: {error['errorType']}\r\n{ERROR_BODY_TRAILER}: {body}\r\n"
            ).encode("latin-1")
        try:
            self._writer.write(b"0\r\n" + trailers + b"\r\n")
            await self._writer.drain()
            status_line = await self._reader.readline()
            parts = status_line.split()
            return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
        finally:
            self.close()

    def close(self) -> None:
        self._writer.close()


def prelude(status: int, raw_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A Function URL's streamed status and headers, ended by eight NUL bytes."""
    headers: dict[str, str] = {}
    cookies: list[str] = []
    for name, value in raw_headers:
        key, text = name.decode("latin-1").lower(), value.decode("latin-1")
        if key == "set-cookie":
            cookies.append(text)
        elif key in ("content-length", "transfer-encoding"):
            continue  # framing is Lambda's, not the app's
        elif key in headers:
            headers[key] = f"{headers[key]}, {text}"
        else:
            headers[key] = text
    return (
        orjson.dumps({"statusCode": status, "headers": headers, "cookies": cookies}) + PRELUDE_END
    )


class Streamer:
    """Answers invocations by streaming them to the Runtime API at `address`."""

    def __init__(self, address: str, app: ASGIApp, instance: Instance) -> None:
        self.address = address
        self.app = app
        self.instance = instance

    async def http(self, request: HttpRequest, request_id: str) -> int:
        """Run `request` through the app, streaming its answer as a Function URL would;
        the answer's status. Errors once streaming are the trailers, never raised."""
        post: StreamedPost | None = None
        status = 0
        done = asyncio.Event()
        sent_body = False

        async def receive() -> Message:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            nonlocal post, status
            try:
                if message["type"] == "http.response.start":
                    status = message["status"]
                    post = await StreamedPost.open(self.address, request_id, HTTP_INTEGRATION)
                    await post.write(prelude(status, list(message.get("headers", []))))
                elif message["type"] == "http.response.body" and post is not None:
                    await post.write(message.get("body", b""))
                    if not message.get("more_body", False):
                        done.set()
            except OSError:
                done.set()  # Lambda closed the stream: the app sees a disconnect
                raise

        error: LambdaError | None = None
        try:
            await self.app(_scope(request), receive, send)
        except Exception as exc:
            if post is None:
                raise  # nothing streamed yet: the loop posts the error as usual
            log.warning("invocation %s failed while streaming: %r", request_id, exc)
            error = lambda_error(exc)
        finally:
            done.set()
        if post is None:
            raise ThawError("the app answered nothing")
        with contextlib.suppress(OSError):
            await post.finish(error)
        return status

    async def direct(
        self, event: Mapping[str, Any], request_id: str, wait_s: float
    ) -> tuple[bytes, int] | None:
        """A direct event with `"stream": true`: its items as JSON lines, then its output.
        Returns the payload to post when it was not streamed (a 202's job object)."""
        name = event["handler"]
        answer = await self.instance.invoke(
            name, event.get("input", {}), wait_s=wait_s, policy=STREAM, request_id=request_id
        )
        stream = answer.stream
        if stream is None:
            if answer.job is None:
                raise InvalidEvent("a streaming invocation ended without a stream")
            return orjson.dumps(answer.job.public()), 202
        post = await StreamedPost.open(self.address, request_id, NDJSON)
        error: LambdaError | None = None
        try:
            async for batch in stream.follow(0, 3600.0):
                lines = b"".join(orjson.dumps(item, option=JSON_OPTIONS) + b"\n" for item in batch)
                await post.write(lines)
            if stream.error is not None:
                error = lambda_error(stream.error)
            else:
                await post.write(b'{"output":' + encode_output(name, stream.result) + b"}\n")
        except OSError:
            stream.close()  # the caller went away
            post.close()
            return None
        except Exception as exc:
            stream.close()
            error = lambda_error(exc)
        with contextlib.suppress(OSError):
            await post.finish(error)
        return None


def _scope(request: HttpRequest) -> dict[str, Any]:
    path, _, query = request.target.partition("?")
    from urllib.parse import unquote

    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": unquote(path),
        "raw_path": path.encode("ascii"),
        "query_string": query.encode("ascii"),
        "root_path": "",
        "headers": [(k.lower(), v) for k, v in request.raw_headers],
        "client": ("127.0.0.1", 0),
        "server": ("lambda", 80),
    }
