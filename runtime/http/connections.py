"""The one place Thaw reaches below ASGI: the server's connections (an adapter).

A connection needs three things ASGI has no words for:

- a request head must arrive within the keep-alive timeout of the connection's
  start or of its last answer, or the connection is closed: a client that
  connects and stays silent, one that trickles a head a byte at a time, and one
  that trickles on a body nobody reads (a 404, a 413, /drain answered before
  the body was read). uvicorn arms its own keep-alive timer only after a first
  response, and any byte received puts it off;
- a busy server sends each response in one write (`OneSendPerTurn`, writes.py);
- when the server stops, the requests still running are cut off at once, and
  `Edge` answers each 503 `drained` (uvicorn would cancel them after its
  graceful-shutdown timeout, log an error and answer a text/plain 500).

`Connections.protocol()` is the protocol class given to `uvicorn.Config(http=…)`:
it holds uvicorn's h11 protocol (the one `http="h11"` names; h11 bounds a head
still arriving, httptools does not) and stands between it and asyncio, by
composition: it hands it a wrapped transport and every event asyncio delivers,
and reads none of its state. What it relies on is the contract of `http=` (the
class is made with the keywords `config`, `server_state`, `app_state`, `_loop`)
the server's request tasks in `server_state.tasks` (a busy server joins its
writes; a stopping one cancels them), and asyncio's Protocol and Transport;
tests/http/test_connections.py and test_writes.py run it on the installed uvicorn.

`Connections.app(app)` is the per-request layer that tells a connection when
its requests begin and end: while uvicorn's protocol reads a connection's
bytes it may start a request task, which copies the context where
`CONNECTION` names the connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from runtime.clock import SYSTEM, Clock, Timer
from runtime.http.writes import OneSendPerTurn

# The connection whose bytes are being read: a request task started meanwhile copies it.
CONNECTION: ContextVar[Connection | None] = ContextVar("thaw_connection", default=None)


class Connections:
    """The server's live connections and the requests running on them."""

    def __init__(self, keep_alive_s: float, clock: Clock = SYSTEM) -> None:
        self.keep_alive_s = keep_alive_s
        # Head timers run on it (tests pass a manual one); the system's is the loop's own.
        self.clock = clock
        self.live: set[Connection] = set()
        # The requests running: the server's request tasks (uvicorn's
        # `server_state.tasks`, which every connection is handed).
        self.running: set[asyncio.Task[Any]] = set()
        self.stopped = False

    def protocol(self) -> type[asyncio.Protocol]:
        """The protocol class for `uvicorn.Config(http=…)`: uvicorn makes each instance."""

        class Protocol(Connection):
            owner = self

        return Protocol

    def app(self, app: ASGIApp) -> ASGIApp:
        """`app`, each HTTP request counted on its connection while it runs."""
        return _Requests(app, self)

    def stop(self) -> None:
        """Cut off every request still running, and any that begins from now on."""
        self.stopped = True
        for task in list(self.running):
            task.cancel()


class _Requests:
    """The per-request layer of `Connections.app` (lifespan and in-process calls pass)."""

    __slots__ = ("app", "connections")

    def __init__(self, app: ASGIApp, connections: Connections) -> None:
        self.app = app
        self.connections = connections

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        connection = CONNECTION.get()
        if connection is None:
            await self.app(scope, receive, send)
            return
        connection.began()
        if self.connections.stopped:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()  # its first wait ends it: `Edge` answers 503 `drained`
        try:
            await self.app(scope, receive, send)
        finally:
            connection.ended()


class Connection(asyncio.Protocol):
    """One client connection: uvicorn's h11 protocol inside, its head timer outside."""

    owner: Connections  # set on the class `Connections.protocol` makes

    def __init__(
        self,
        config: Any,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.inner = H11Protocol(
            config=config, server_state=server_state, app_state=app_state, _loop=_loop
        )
        self.tasks: set[asyncio.Task[Any]] = server_state.tasks
        self.owner.running = self.tasks
        self.loop = _loop or asyncio.get_running_loop()
        clock = self.owner.clock
        system = clock is SYSTEM
        # The system clock's timers are the loop's own, on its clock (monotonic).
        self.now: Callable[[], float] = self.loop.time if system else clock.monotonic
        self.call_at: Callable[[float, Callable[[], None]], Timer] = (
            self.loop.call_at if system else clock.call_at
        )
        self.transport: OneSendPerTurn | None = None
        self.in_flight = 0
        # When the wait for a next head ends; None while a request runs.
        self.idle_until: float | None = None
        self.timer: Timer | None = None

    # ---- asyncio's side ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        # Busy: other request cycles in flight beside this connection's own (the
        # server's tasks, which uvicorn hands every protocol it makes).
        tasks = self.tasks
        self.transport = OneSendPerTurn(transport, self.loop, lambda: len(tasks) > 1)
        self.owner.live.add(self)
        self.inner.connection_made(self.transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        token = CONNECTION.set(self)
        try:
            self.inner.data_received(data)
        finally:
            CONNECTION.reset(token)

    def eof_received(self) -> None:
        # Falsy: asyncio closes the transport (uvicorn's answer too).
        self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self.owner.live.discard(self)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    # ---- the requests' side --------------------------------------------------------

    def began(self) -> None:
        """A request's head arrived whole and its app runs: no timer while it does."""
        self.in_flight += 1
        self._disarm()

    def ended(self) -> None:
        """A request's app returned (answered): what it wrote leaves now, and the
        next head must come within the keep-alive timeout."""
        self.in_flight -= 1
        transport = self.transport
        assert transport is not None
        transport.flush()
        if not self.in_flight and not transport.is_closing():
            self._arm()

    # One timer per connection, not one per request: a request moves `idle_until`
    # and the timer, when it fires, re-arms itself for the time that is left.
    # Arming and cancelling a loop timer for every request cost a busy server
    # more than the rest of this adapter together.

    def _arm(self) -> None:
        self.idle_until = until = self.now() + self.owner.keep_alive_s
        if self.timer is None:
            self.timer = self.call_at(until, self._idle)

    def _disarm(self) -> None:
        self.idle_until = None

    def _cancel_timer(self) -> None:
        self.idle_until = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _idle(self) -> None:
        self.timer = None
        until = self.idle_until
        if until is None or self.transport is None:
            return  # a request runs: its end arms the timer again
        if self.now() < until:
            self.timer = self.call_at(until, self._idle)
            return
        self.transport.close()
