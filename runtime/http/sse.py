"""Server-sent events (text/event-stream) of a stream: invocations and jobs.

    id: 0                      one event per item, as soon as it exists; the id
    data: {"text": "Par"}      is its index (a follower resumes after Last-Event-ID)

    event: result              the complete output (the items joined)
    data: {"text": "Paris", "finish_reason": "stop", "usage": {...}}

    event: error               the handler failed midway: a problem+json object
    data: {"type": ..., "title": ..., "status": 500, "detail": ...}

    : keep-alive               a comment after THAW_SSE_HEARTBEAT_S without an event

Nothing between the handler and the socket holds an event back: the response
is pure ASGI, each batch of items is one `http.response.body` message (uvicorn
writes it at once as an HTTP/1.1 chunk), `Edge` passes messages through, and
the app compresses nothing. `X-Accel-Buffering: no` asks proxies (nginx) to do
the same.

A client that goes away (`http.disconnect`, or a send that fails) closes the
invocation's stream, which cancels its work within one item (runtime/dispatch/
streams.py); a follower of a job only stops following.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

from runtime.dispatch.streams import Stream
from runtime.errors import InvalidOutput, ThawError
from runtime.jobs.job import Job, JobStatus
from runtime.wire.outputs import JSON_OPTIONS, encode_output
from runtime.wire.render import problem

MEDIA_TYPE = "text/event-stream"
HEARTBEAT = b": keep-alive\n\n"
_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def wants_events(accept: str) -> bool:
    """Whether an Accept header asks for text/event-stream."""
    return MEDIA_TYPE in accept.lower()


def item_event(index: int, item: Any) -> bytes:
    return b"id: %d\ndata: %b\n\n" % (index, orjson.dumps(item, option=JSON_OPTIONS))


def data_event(value: Any) -> bytes:
    """An event of data alone (OpenAI's streams are these)."""
    return b"data: " + orjson.dumps(value, default=str) + b"\n\n"


def result_event(output_json: bytes) -> bytes:
    return b"event: result\ndata: " + output_json + b"\n\n"


def error_event(exc: BaseException, path: str | None) -> bytes:
    error = exc if isinstance(exc, ThawError) else ThawError("internal error; see the server log")
    return b"event: error\ndata: " + orjson.dumps(problem(error, path), default=str) + b"\n\n"


def job_final_event(job: Job, path: str) -> bytes:
    """The last event of a followed job that ended: its output, or its error."""
    if job.status is JobStatus.SUCCEEDED:
        return result_event(orjson.dumps(job.output, option=JSON_OPTIONS))
    error = job.error or {"type": "internal", "message": str(job.status)}
    return b"event: error\ndata: " + orjson.dumps({**error, "instance": path}) + b"\n\n"


async def stream_events(
    stream: Stream,
    start: int,
    heartbeat_s: float,
    path: str,
    cut_end: Callable[[], Awaitable[bytes | None]] | None = None,
) -> AsyncIterator[bytes]:
    """The stream's events from item `start` on, heartbeats in the gaps, then its end.

    `cut_end`: for a job's follower, the last event when the run was cut off (its
    outcome cancelled): the job's record says why (a cancel), so a live follower
    ends as one that comes later does; None (a drain: the job runs again) keeps
    the stream's own error."""
    index = start
    async for batch in stream.follow(start, heartbeat_s):
        if not batch:
            yield HEARTBEAT
            continue
        chunk = bytearray()
        for item in batch:
            try:
                chunk += item_event(index, item)
            except TypeError as exc:
                stream.close()
                bad = InvalidOutput(
                    f"handler {stream.spec.name!r} yielded an item that is not JSON: {exc}",
                    handler=stream.spec.name,
                )
                yield bytes(chunk) + error_event(bad, path)
                return
            index += 1
        yield bytes(chunk)
    if stream.cut_off and cut_end is not None and (recorded := await cut_end()) is not None:
        yield recorded
        return
    if stream.error is not None:
        yield error_event(stream.error, path)
        return
    try:
        body = encode_output(stream.spec.name, stream.result)
    except ThawError as exc:
        yield error_event(exc, path)
        return
    yield result_event(body)


async def stored_events(
    stored: AsyncGenerator[list[Any] | Job, None], start: int, path: str
) -> AsyncGenerator[bytes, None]:
    """A followed job's events read from the store (runtime/jobs/items.py): its items
    from index `start`, heartbeats in the gaps, then its end."""
    index = start
    # A comment at once, as the store is read: the follower (and a proxy) knows the
    # stream is open before the first item, however long that takes.
    yield HEARTBEAT
    async with contextlib.aclosing(stored):  # a follower gone stops watching at once
        async for read in stored:
            if isinstance(read, Job):
                yield job_final_event(read, path)
                return
            if not read:
                yield HEARTBEAT
                continue
            chunk = bytearray()
            for item in read:
                chunk += item_event(index, item)
                index += 1
            yield bytes(chunk)


class EventStreamResponse:
    """An ASGI response sending `events`; on a client's disconnect, `on_disconnect()`;
    once it ended however it did, `on_end()` (the connection's hold is given back)."""

    def __init__(
        self,
        events: AsyncIterator[bytes],
        *,
        on_disconnect: Callable[[], None] | None = None,
        headers: dict[str, str] | None = None,
        on_end: Callable[[], None] | None = None,
    ) -> None:
        self.events = events
        self.on_disconnect = on_disconnect
        self.on_end = on_end
        self.headers = [
            *_HEADERS,
            *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items()),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = asyncio.Event()

        async def watch() -> None:
            # The request body was read already: what comes next is the disconnect.
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            if self.on_disconnect is not None:
                self.on_disconnect()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            async for chunk in self.events:
                if gone.is_set():
                    return
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            # uvicorn's ClientDisconnected: the socket closed under a send.
            if self.on_disconnect is not None:
                self.on_disconnect()
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            try:
                aclose = getattr(self.events, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                if self.on_end is not None:
                    self.on_end()


async def invocation_response(
    stream: Stream,
    heartbeat_s: float,
    path: str,
    headers: dict[str, str],
    on_end: Callable[[], None] | None = None,
) -> EventStreamResponse:
    """The event stream of an invocation that began. Its headers wait for the first
    item (at most `heartbeat_s`), so a handler that refuses its input before
    yielding anything (invalid-input) is answered with its problem and status,
    not a 200 stream of one error event."""
    await stream.wait_change(0, heartbeat_s)
    if stream.ended and stream.error is not None and not stream.items:
        raise stream.error
    return EventStreamResponse(
        stream_events(stream, 0, heartbeat_s, path),
        on_disconnect=stream.close,
        headers=headers,
        on_end=on_end,
    )
