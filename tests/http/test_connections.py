"""The connection adapter (runtime/http/connections.py) on the installed uvicorn.

Each connection is the protocol class `thaw serve` gives uvicorn, made as
uvicorn makes it, over `Wire` (an asyncio transport that records writes and
closes), with a real ASGI app; its head timer runs on a manual clock, so a
timeout passes by `advance`, never by waiting.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from runtime.clock import ManualClock
from runtime.http.connections import Connections
from tests.http.test_writes import Wire

pytestmark = pytest.mark.anyio

KEEP_ALIVE_S = 5.0


class Served:
    """An app that answers `/quick` at once and holds `/held` until `release` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.cancelled: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        if scope["path"] == "/held":
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.append(scope["path"])
                raise
        body = scope["path"].encode()
        headers = [(b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class Server:
    """Connections made as uvicorn makes them, over wires, on a manual clock."""

    def __init__(self) -> None:
        self.clock = ManualClock()
        self.connections = Connections(KEEP_ALIVE_S, self.clock)
        self.app = Served()
        self.config = uvicorn.Config(
            self.connections.app(self.app), lifespan="off", log_level="warning"
        )
        self.config.load()
        self.state = ServerState()

    def connect(self) -> tuple[asyncio.Protocol, Wire]:
        make = self.connections.protocol()
        protocol = make(config=self.config, server_state=self.state, app_state={})  # type: ignore[call-arg]
        wire = Wire()
        protocol.connection_made(wire)
        return protocol, wire


async def turns(count: int = 20) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


def request(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: test\r\n\r\n".encode()


async def test_a_connection_that_never_sends_is_closed_at_the_keep_alive_timeout() -> None:
    server = Server()
    protocol, wire = server.connect()
    server.clock.advance(KEEP_ALIVE_S - 0.01)
    assert not wire.closing
    server.clock.advance(0.01)
    assert wire.closing and wire.sent == []
    protocol.connection_lost(None)
    assert not server.connections.live


async def test_a_trickled_head_is_closed_at_the_timeout_of_the_connection_s_start() -> None:
    server = Server()
    protocol, wire = server.connect()
    head = request("/quick")
    sent = 0
    while not wire.closing and sent < len(head):  # a byte a second: none puts it off
        protocol.data_received(head[sent : sent + 1])
        sent += 1
        server.clock.advance(1.0)
    assert wire.closing and wire.sent == []
    assert sent == KEEP_ALIVE_S


async def test_a_running_request_holds_its_connection_and_its_answer_rearms_the_timer() -> None:
    server = Server()
    protocol, wire = server.connect()
    protocol.data_received(request("/held"))
    await turns()
    server.clock.advance(KEEP_ALIVE_S * 10)  # the request runs: no timer
    assert not wire.closing
    server.app.release.set()
    await turns()
    assert b"".join(wire.sent).endswith(b"/held")
    # Kept alive for the next request's head, for the keep-alive timeout.
    server.clock.advance(KEEP_ALIVE_S - 0.01)
    assert not wire.closing
    protocol.data_received(request("/quick"))
    await turns()
    assert b"".join(wire.sent).endswith(b"/quick")
    server.clock.advance(KEEP_ALIVE_S)
    assert wire.closing


async def test_a_body_nobody_reads_cannot_hold_the_connection_past_the_timeout() -> None:
    server = Server()
    protocol, wire = server.connect()
    head = b"POST /quick HTTP/1.1\r\nhost: test\r\ncontent-length: 1000\r\n\r\n"
    protocol.data_received(head + b"{")
    await turns()
    assert b"".join(wire.sent).endswith(b"/quick")  # answered before its body was read
    for _ in range(10):  # the rest trickles on
        server.clock.advance(KEEP_ALIVE_S / 10)
        if not wire.closing:
            protocol.data_received(b" ")
    assert wire.closing


async def test_stop_cuts_off_running_requests_and_any_that_begin_after() -> None:
    server = Server()
    first, _ = server.connect()
    first.data_received(request("/held"))
    await turns()
    assert len(server.connections.running) == 1
    server.connections.stop()
    await turns()
    assert server.app.cancelled == ["/held"] and not server.connections.running
    late, _ = server.connect()
    late.data_received(request("/held"))
    await turns()
    assert server.app.cancelled == ["/held", "/held"]
