"""A request's body: read whole within its limits (`Intake`), then parsed as JSON
nested no deeper than THAW_MAX_JSON_DEPTH (`parse_json`).

Request bodies are read by `Intake` (one per app): each must arrive whole
within THAW_BODY_TIMEOUT_S (408 and the connection closed), and the bytes
held by bodies across every connection stay under THAW_MAX_BUFFERED_BYTES
(503 `overloaded` past it), so slow or stalled clients cannot hold the
server's memory or its connections forever.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request

from runtime.clock import SYSTEM, Clock, Timer
from runtime.errors import BadRequest, InvalidJSON, Overloaded, PayloadTooLarge, RequestTimeout
from runtime.http.edge import header_of
from runtime.wire.nesting import nests_deeper


class Intake:
    """Request bodies being read, across every connection of one app.

    Each body must arrive whole within `timeout_s` (THAW_BODY_TIMEOUT_S) of
    the start of its read, or its request is answered 408 and its connection
    closed: a client trickling bytes, or one whose body stops short of its
    Content-Length, holds a connection and its buffer for that long at most.
    The bytes bodies hold stay under `limit` (THAW_MAX_BUFFERED_BYTES): a body
    whose next chunk would pass it is answered 503 `overloaded`. A request's
    bytes are counted as they arrive and given back (`release`) when it is done.
    Bodies still arriving may not take the last `reserve` bytes (64 KiB, or a
    quarter of a smaller cap): clients that stall mid-body fill the cap only so
    far, and a request whose body arrives whole is still served beside them.

    One timer on the instance's clock serves every read (as
    runtime/dispatch/deadlines.py does for waiting requests): a read costs two
    dict operations, not a timer of its own. A read past its deadline has its
    task cancelled, and turns that cancellation into RequestTimeout.
    """

    def __init__(self, limit: int, timeout_s: float, clock: Clock = SYSTEM) -> None:
        self.limit = limit
        self.reserve = min(64 * 1024, limit // 4)
        self.timeout_s = timeout_s
        self.buffered = 0
        self.clock = clock
        # The clock's reading itself (a plain function): read on every request.
        self._monotonic = clock.monotonic
        self._reading: dict[asyncio.Task[Any], float] = {}
        self._late: set[asyncio.Task[Any]] = set()
        self._timer: Timer | None = None
        self._timer_at = 0.0

    async def read(self, request: Request, max_body_bytes: int) -> bytes:
        """The whole body, counted in `buffered` until `release(len(body))`."""
        declared = header_of(request, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise PayloadTooLarge(
                f"body of {declared} bytes exceeds THAW_MAX_BODY_BYTES={max_body_bytes}",
                limit_bytes=max_body_bytes,
            )
        task = asyncio.current_task()
        if task is not None:
            deadline = self._monotonic() + self.timeout_s
            self._reading[task] = deadline
            # With one timeout for all, deadlines only grow: the timer rarely moves.
            if self._timer is None or deadline < self._timer_at:
                self._arm(deadline)
        receive = request.receive
        chunks: list[bytes] = []
        size = 0
        try:
            try:
                while True:
                    message = await receive()
                    if message["type"] != "http.request":  # http.disconnect
                        raise ClientDisconnect()
                    chunk: bytes = message.get("body", b"")
                    more: bool = message.get("more_body", False)
                    if chunk:
                        if size + len(chunk) > max_body_bytes:
                            raise PayloadTooLarge(
                                f"body exceeds THAW_MAX_BODY_BYTES={max_body_bytes}",
                                limit_bytes=max_body_bytes,
                            )
                        # Whole at once, or still arriving (kept out of the reserve).
                        room = self.limit - self.reserve if more or size else self.limit
                        if self.buffered + len(chunk) > room:
                            raise self._overloaded(len(chunk), room)
                        self.buffered += len(chunk)
                        size += len(chunk)
                        chunks.append(chunk)
                    if not more:
                        break
            except asyncio.CancelledError:
                if task is not None and task in self._late and task.uncancel() == 0:
                    raise RequestTimeout(
                        f"the request body did not arrive within THAW_BODY_TIMEOUT_S="
                        f"{self.timeout_s:g} s ({size} bytes received)",
                        timeout_s=self.timeout_s,
                    ) from None
                raise
        except BaseException:
            self.buffered -= size
            raise
        finally:
            if task is not None:
                del self._reading[task]
                if self._late:
                    self._late.discard(task)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def release(self, size: int) -> None:
        """Give back the bytes of a body `read` returned: its request is done."""
        self.buffered -= size

    def _overloaded(self, size: int, room: int) -> Overloaded:
        kept = "" if room == self.limit else f" less {self.reserve} kept for whole bodies"
        # Bytes come back as requests finish; a body still arriving holds its
        # bytes THAW_BODY_TIMEOUT_S at most.
        return Overloaded(
            f"{self.buffered} bytes of request bodies are buffered; {size} more would pass "
            f"THAW_MAX_BUFFERED_BYTES={self.limit}{kept}",
            limit_bytes=self.limit,
            retry_after_s=1.0,
        )

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.clock.call_at(at, self._fire)
        self._timer_at = at

    def _fire(self) -> None:
        self._timer = None
        now = self._monotonic()
        earliest: float | None = None
        for task, at in self._reading.items():
            if task in self._late:
                continue
            if at <= now:
                self._late.add(task)
                task.cancel()
            elif earliest is None or at < earliest:
                earliest = at
        if earliest is not None:
            self._arm(earliest)


def parse_json(body: bytes, max_depth: int = 64) -> Any:
    """`body` as JSON (empty is `{}`), refusing documents nested deeper than `max_depth`."""
    if not body or body.isspace():  # not `strip()`, which copies a large body to test it
        return {}
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidJSON(f"body is not valid JSON: {exc}") from exc
    if nests_deeper(body, value, max_depth):
        raise BadRequest(
            f"JSON nesting exceeds THAW_MAX_JSON_DEPTH={max_depth}", max_json_depth=max_depth
        )
    return value
