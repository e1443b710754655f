"""Request bodies read by `Intake` (runtime/http/intake.py) on the instance's clock.

A body must arrive whole within its timeout of the start of its read: here the
clock is a manual one, so the timeout passes by `advance`, never by waiting,
and a body that keeps arriving in time is read whole however late it ends.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import Request

from runtime.clock import ManualClock
from runtime.errors import RequestTimeout
from runtime.http.intake import Intake

pytestmark = pytest.mark.anyio

TIMEOUT_S = 30.0


class Body:
    """A request whose body chunks the test hands over one at a time."""

    def __init__(self) -> None:
        self.chunks: asyncio.Queue[tuple[bytes, bool]] = asyncio.Queue()
        scope: dict[str, Any] = {"type": "http", "method": "POST", "headers": []}
        self.request = Request(scope, self.receive)

    async def receive(self) -> dict[str, Any]:
        body, more = await self.chunks.get()
        return {"type": "http.request", "body": body, "more_body": more}


async def test_a_body_that_stops_short_times_out_when_the_clock_passes_its_deadline() -> None:
    clock = ManualClock()
    intake = Intake(limit=1 << 20, timeout_s=TIMEOUT_S, clock=clock)
    body = Body()
    read = asyncio.ensure_future(intake.read(body.request, max_body_bytes=1 << 20))
    body.chunks.put_nowait((b'{"x": ', True))
    await asyncio.sleep(0)
    clock.advance(TIMEOUT_S - 1)
    await asyncio.sleep(0)
    assert not read.done()
    clock.advance(1)
    for _ in range(10):
        await asyncio.sleep(0)
    assert read.done()  # cut off by the clock's timer, not by any wait here
    with pytest.raises(RequestTimeout, match="THAW_BODY_TIMEOUT_S=30"):
        await read
    assert intake.buffered == 0  # its bytes given back


async def test_a_body_that_arrives_within_its_time_is_read_whole() -> None:
    clock = ManualClock()
    intake = Intake(limit=1 << 20, timeout_s=TIMEOUT_S, clock=clock)
    body = Body()
    read = asyncio.ensure_future(intake.read(body.request, max_body_bytes=1 << 20))
    body.chunks.put_nowait((b'{"x": ', True))
    await asyncio.sleep(0)
    clock.advance(TIMEOUT_S - 1)
    body.chunks.put_nowait((b"1}", False))
    assert await read == b'{"x": 1}'
    assert intake.buffered == 8
    intake.release(8)
    clock.advance(TIMEOUT_S)  # its timer finds nothing left to cut off
    assert intake.buffered == 0
