"""A small HTTP/1.1 server for ASGI apps, on h11: the Runtime API listeners' server.

A sandbox's Runtime API listener (runtime_api.py) needs two things a uvicorn
server gives only through its internals: a chunked request's trailers (a
streamed response reports its failure in them, streaming.py), which uvicorn's
h11 protocol drops; and no signal handling of its own (the emulator's server
owns SIGINT and SIGTERM, and `uvicorn.Server.serve` installs handlers for every
server it runs, then raises a caught signal again when it stops). So the
listeners run here: one asyncio protocol per connection, h11 (its public API)
for the wire, keep-alive, one request at a time per connection, bodies handed
to the app as they arrive, a request's trailers appended to its scope's
headers once its body has ended. It serves the emulator's few clients on
127.0.0.1, not the internet: no TLS, no upgrade, no pipelining beyond h11's
pausing, and a connection closes rather than discard an unread body.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any

import h11
from starlette.types import ASGIApp, Message

log = logging.getLogger("thaw.emulator")

# A request head larger than this is refused (400) and its connection closed.
MAX_HEAD_BYTES = 64 * 1024


class Server:
    """`app` served on a bound socket until `close`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.connections: set[_Connection] = set()
        self._server: asyncio.base_events.Server | None = None

    async def start(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), sock=sock)

    def close(self) -> None:
        """Stop listening; idle connections close now, busy ones once answered."""
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.close_when_idle()

    async def wait_closed(self, grace_s: float = 1.0) -> None:
        """Until every connection closed; those still busy after `grace_s` are cut off."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.connections and loop.time() < deadline:
            await asyncio.sleep(0.01)
        for connection in list(self.connections):
            connection.abort()
        if self._server is not None:
            await self._server.wait_closed()


class _Connection(asyncio.Protocol):
    """One client connection: h11's state machine, one ASGI request cycle at a time."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.transport: asyncio.Transport | None = None
        self.cycle: _Cycle | None = None
        self.closing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        self.conn.receive_data(data)
        self._handle_events()

    def eof_received(self) -> None:
        self.conn.receive_data(b"")
        self._handle_events()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        if self.cycle is not None:
            self.cycle.disconnected = True
            self.cycle.wake()

    def close_when_idle(self) -> None:
        self.closing = True
        if self.cycle is None and self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.cycle is not None and self.cycle.task is not None:
            self.cycle.task.cancel()
        if self.transport is not None:
            self.transport.abort()

    def _handle_events(self) -> None:
        while self.transport is not None and not self.transport.is_closing():
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as exc:
                self._refuse(exc)
                return
            if event is h11.NEED_DATA:
                return
            if event is h11.PAUSED:  # the next request, while this one is answered
                self.transport.pause_reading()
                return
            if isinstance(event, h11.Request):
                self.cycle = _Cycle(self, event)
            elif isinstance(event, h11.Data) and self.cycle is not None:
                self.cycle.chunks.append(event.data)
                self.cycle.wake()
            elif isinstance(event, h11.EndOfMessage) and self.cycle is not None:
                # The trailers, after the body: read by the app once its body has ended.
                self.cycle.scope["headers"].extend(
                    (bytes(name).lower(), bytes(value)) for name, value in event.headers
                )
                self.cycle.ended = True
                self.cycle.wake()
            elif isinstance(event, h11.ConnectionClosed):
                return

    def _refuse(self, exc: h11.RemoteProtocolError) -> None:
        assert self.transport is not None
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            body = f"Invalid HTTP request: {exc}".encode()
            headers = [(b"content-type", b"text/plain"), (b"connection", b"close")]
            with contextlib.suppress(h11.LocalProtocolError):
                self.transport.write(
                    self.conn.send(h11.Response(status_code=exc.error_status_hint, headers=headers))
                    + self.conn.send(h11.Data(data=body))
                    + self.conn.send(h11.EndOfMessage())
                )
        self.transport.close()

    def cycle_done(self) -> None:
        """The response was sent whole: the next request, or the connection's end."""
        self.cycle = None
        transport = self.transport
        assert transport is not None
        if (
            self.closing
            or self.conn.our_state is not h11.DONE
            or self.conn.their_state is not h11.DONE
        ):
            # Not reusable (h11 says close, an unread body, the server stops).
            transport.close()
            return
        self.conn.start_next_cycle()
        transport.resume_reading()
        self._handle_events()


class _Cycle:
    """One request and its response: the ASGI `receive` and `send` of one call."""

    def __init__(self, connection: _Connection, request: h11.Request) -> None:
        self.connection = connection
        target = bytes(request.target)
        raw_path, _, query = target.partition(b"?")
        transport = connection.transport
        assert transport is not None
        self.scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version.decode("ascii"),
            "method": request.method.decode("ascii"),
            "scheme": "http",
            "path": raw_path.decode("latin-1"),
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": [(bytes(name).lower(), bytes(value)) for name, value in request.headers],
            "client": transport.get_extra_info("peername"),
            "server": transport.get_extra_info("sockname"),
        }
        self.chunks: list[bytes] = []
        self.ended = False  # the body arrived whole (h11's EndOfMessage)
        self.said_end = False  # and `receive` has said so
        self.disconnected = False
        self.started = False
        self._waiter: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = asyncio.get_running_loop().create_task(self._run())

    def wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def receive(self) -> Message:
        while True:
            if self.chunks:
                body = b"".join(self.chunks)
                self.chunks.clear()
                self.said_end = self.ended
                return {"type": "http.request", "body": body, "more_body": not self.ended}
            if self.disconnected:
                return {"type": "http.disconnect"}
            if self.ended and not self.said_end:
                self.said_end = True  # said once; after it, only a disconnect
                return {"type": "http.request", "body": b"", "more_body": False}
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter

    async def send(self, message: Message) -> None:
        connection = self.connection
        transport = connection.transport
        if self.disconnected or transport is None or transport.is_closing():
            return
        conn = connection.conn
        if message["type"] == "http.response.start":
            self.started = True
            headers = list(message.get("headers", ()))
            transport.write(conn.send(h11.Response(status_code=message["status"], headers=headers)))
        elif message["type"] == "http.response.body":
            body = message.get("body", b"")
            if body:
                transport.write(conn.send(h11.Data(data=body)))
            if not message.get("more_body", False):
                transport.write(conn.send(h11.EndOfMessage()))
                connection.cycle_done()

    async def _run(self) -> None:
        try:
            await self.connection.server.app(self.scope, self.receive, self.send)
        except Exception:
            log.exception("the Runtime API failed a request")
            transport = self.connection.transport
            if transport is None or transport.is_closing():
                return
            if not self.started:
                await self.send(
                    {
                        "type": "http.response.start",
                        "status": 500,
                        "headers": [(b"content-length", b"0"), (b"connection", b"close")],
                    }
                )
                await self.send({"type": "http.response.body", "body": b""})
            else:
                transport.close()
        finally:
            self.task = None
