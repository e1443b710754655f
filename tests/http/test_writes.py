"""A busy server sends each response in one write (runtime/http/writes.py).

The transport under `OneSendPerTurn` here is `Wire`: an asyncio transport that
records what reaches it, as the socket would get it, one `write` per send.
Through the server's own protocol class (uvicorn's h11 protocol inside Thaw's
connection adapter, runtime/http/connections.py) and a real ASGI app, the same
holds: a lone request's head and body are two writes, as uvicorn makes them;
with other requests in flight, one.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from runtime.http.connections import Connections
from runtime.http.writes import JOIN_LIMIT, OneSendPerTurn

pytestmark = pytest.mark.anyio


class Wire(asyncio.Transport):
    """Records writes, closes and aborts; reports the peer as 127.0.0.1."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[bytes] = []
        self.events: list[str] = []
        self.closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closing, "a write after close"
        self.sent.append(bytes(data))
        self.events.append("write")

    def close(self) -> None:
        self.closing = True
        self.events.append("close")

    def abort(self) -> None:
        self.closing = True
        self.events.append("abort")

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8080)}.get(
            name, default
        )

    def pause_reading(self) -> None:
        self.events.append("pause")

    def resume_reading(self) -> None:
        self.events.append("resume")

    def get_write_buffer_size(self) -> int:
        return 0


def over(wire: Wire, *, busy: bool) -> OneSendPerTurn:
    return OneSendPerTurn(wire, asyncio.get_running_loop(), lambda: busy)


async def test_a_busy_server_sends_what_one_turn_wrote_in_one_write() -> None:
    wire = Wire()
    transport = over(wire, busy=True)
    head, body = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n", b"ok"
    transport.write(head)
    transport.write(b"")  # uvicorn's end of a Content-Length body: nothing to send
    transport.write(body)
    assert wire.sent == []
    assert transport.get_write_buffer_size() == len(head + body)
    await asyncio.sleep(0)  # the turn ends
    assert wire.sent == [head + body]


async def test_a_whole_response_leaves_at_once_when_flushed() -> None:
    wire = Wire()
    transport = over(wire, busy=True)
    transport.writelines([b"head ", b"body"])
    transport.flush()  # the protocol's: the response is whole
    assert wire.sent == [b"head body"]
    await asyncio.sleep(0)  # the turn's own flush finds nothing more
    assert wire.sent == [b"head body"]


async def test_a_large_body_goes_through_after_its_head_without_a_copy() -> None:
    wire = Wire()
    transport = over(wire, busy=True)
    big = b"x" * JOIN_LIMIT
    transport.write(b"head")
    transport.write(big)
    assert wire.sent == [b"head", big]
    assert wire.sent[1] is big


async def test_an_idle_server_writes_through() -> None:
    wire = Wire()
    transport = over(wire, busy=False)
    transport.write(b"head")
    assert wire.sent == [b"head"]
    transport.write(b"body")
    assert wire.sent == [b"head", b"body"]


async def test_a_stream_s_chunks_are_never_held_past_their_turn() -> None:
    wire = Wire()
    transport = over(wire, busy=True)
    for chunk in (b"data: 1\n\n", b"data: 2\n\n"):
        transport.write(chunk)
        await asyncio.sleep(0)
        assert wire.sent[-1] == chunk
    assert len(wire.sent) == 2


async def test_a_close_sends_what_is_kept_first_and_an_abort_drops_it() -> None:
    wire = Wire()
    transport = over(wire, busy=True)
    transport.write(b"last words")
    transport.close()
    assert wire.events == ["write", "close"] and wire.sent == [b"last words"]

    wire = Wire()
    transport = over(wire, busy=True)
    transport.write(b"never sent")
    transport.abort()
    await asyncio.sleep(0)
    assert wire.events == ["abort"] and wire.sent == []


async def test_nothing_is_written_to_a_transport_closed_underneath() -> None:
    wire = Wire()
    transport = over(wire, busy=True)
    transport.write(b"too late")
    wire.close()  # the connection was lost before the turn ended
    await asyncio.sleep(0)
    assert wire.sent == []


async def test_the_rest_is_the_transport_s() -> None:
    wire = Wire()
    transport = over(wire, busy=True)
    transport.pause_reading()
    transport.resume_reading()
    assert wire.events == ["pause", "resume"]
    assert transport.get_extra_info("peername") == ("127.0.0.1", 50000)
    assert not transport.is_closing()


# ---- through the server's protocol --------------------------------------------------


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A whole response, its head and body sent back to back (as Starlette's Response)."""
    assert scope["type"] == "http"
    body = scope["path"].encode()
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _connect(config: uvicorn.Config, state: ServerState) -> tuple[Any, Wire]:
    make = CONNECTIONS.protocol()
    protocol = make(config=config, server_state=state, app_state={})  # type: ignore[call-arg]
    wire = Wire()
    protocol.connection_made(wire)
    return protocol, wire


def _request(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: test\r\n\r\n".encode()


async def _answered(*expected: tuple[Wire, bytes]) -> None:
    """Until each wire has its whole response (the cycles run on the loop's next turns)."""
    for _ in range(1000):
        if all(b"".join(wire.sent).endswith(body) for wire, body in expected):
            return
        await asyncio.sleep(0)
    raise AssertionError([wire.sent for wire, _ in expected])


CONNECTIONS = Connections(keep_alive_s=30.0)


@pytest.fixture
def config() -> uvicorn.Config:
    app = CONNECTIONS.app(_app)
    config = uvicorn.Config(app, lifespan="off", log_level="warning", server_header=False)
    config.load()
    return config


async def test_a_lone_request_s_response_is_written_as_uvicorn_makes_it(
    config: uvicorn.Config,
) -> None:
    state = ServerState()
    protocol, wire = _connect(config, state)
    protocol.data_received(_request("/alone"))
    await _answered((wire, b"/alone"))
    assert len(wire.sent) == 2  # head, then body
    assert wire.sent[0].startswith(b"HTTP/1.1 200 OK\r\n") and wire.sent[1] == b"/alone"
    protocol.connection_lost(None)


async def test_with_other_requests_in_flight_each_response_is_one_write(
    config: uvicorn.Config,
) -> None:
    state = ServerState()
    connections = [_connect(config, state) for _ in range(3)]
    for index, (protocol, _) in enumerate(connections):
        protocol.data_received(_request(f"/busy{index}"))
    assert len(state.tasks) == 3  # three request cycles in flight
    await _answered(*((wire, f"/busy{i}".encode()) for i, (_, wire) in enumerate(connections)))
    for index, (protocol, wire) in enumerate(connections):
        assert len(wire.sent) == 1, wire.sent
        head, _, body = wire.sent[0].partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK") and body == f"/busy{index}".encode()
        protocol.connection_lost(None)
