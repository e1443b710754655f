"""`thaw serve`: the HTTP app on uvicorn, with drain wired to process exit."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import socket
import sys
from collections.abc import Callable
from types import FrameType

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from runtime import process
from runtime.errors import ConfigError
from runtime.http.app import create_app
from runtime.http.writes import OneSendPerTurn
from runtime.instance import Instance
from runtime.models.weights import host as host_memory
from runtime.registry import discover
from runtime.settings import Settings, forget_secrets
from runtime.telemetry.logs import configure_logging
from runtime.version import __version__


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _H11Protocol(H11Protocol):
    """uvicorn's h11 protocol, also closing connections that never send a request,
    or that keep sending a body nobody reads.

    uvicorn arms its keep-alive timer only after a first response, so a client
    that connects and stays silent would hold a connection forever; and it
    disarms it on any byte received, so a client trickling a request head a
    byte at a time would too. Here the timer runs until a whole head arrived:
    a request must be sent within the keep-alive timeout of the connection's
    start or its last response. Naming the class also pins h11, whose
    header-size limit we rely on (httptools has none). The attributes used here
    (`timeout_keep_alive_task`, `conn`, `cycle`) are uvicorn's internals:
    pyproject.toml pins uvicorn to the range the tests ran with.

    Its transport is `OneSendPerTurn` (runtime/http/writes.py): while other
    requests are in flight, a response's head and body leave in one send(2),
    not the two uvicorn's writes make; the response is flushed as it completes.

    A request answered before its body was read (404, 405, 413, /drain) leaves
    the rest of the body to be read and discarded, and each byte of it would
    put off uvicorn's keep-alive timeout again: a client trickling it holds the
    connection forever. It must end within THAW_BODY_TIMEOUT_S, as a body the
    app reads must (runtime.http.intake.Intake), or the connection is closed.
    """

    # THAW_BODY_TIMEOUT_S; `serve` sets it on a subclass of its own.
    body_timeout_s = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # A busy server sends a response's head and body at once (runtime/http/writes.py);
        # uvicorn's flow control keeps the transport itself. `tasks` holds the request
        # cycles in flight, this connection's own among them.
        tasks = self.server_state.tasks
        self.transport = OneSendPerTurn(transport, self.loop, lambda: len(tasks) > 1)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def data_received(self, data: bytes) -> None:
        timer, self.timeout_keep_alive_task = self.timeout_keep_alive_task, None
        super().data_received(data)
        if timer is not None:
            if self.conn.their_state is h11.IDLE:  # no whole request head yet
                self.timeout_keep_alive_task = timer
            else:
                timer.cancel()

    def on_response_complete(self) -> None:
        # The response is whole: it leaves now, not at the end of the loop's turn,
        # ahead of whatever else this turn runs (a job's work after its 202).
        assert isinstance(self.transport, OneSendPerTurn)
        self.transport.flush()
        super().on_response_complete()
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self.loop.call_later(self.body_timeout_s, self._unread_body_overdue, self.cycle)

    def _unread_body_overdue(self, cycle: object) -> None:
        # Still the same request, still sending its body: nobody waits for it.
        if self.cycle is cycle and self.conn.their_state is h11.SEND_BODY:
            self.transport.close()


def _h11_protocol(body_timeout_s: float) -> type[_H11Protocol]:
    """The protocol class for this server: uvicorn makes each instance itself."""

    class Protocol(_H11Protocol):
        pass

    Protocol.body_timeout_s = body_timeout_s
    return Protocol


class _Server(uvicorn.Server):
    """uvicorn, telling us when it listens (background loads start after that),
    draining on SIGTERM while it keeps serving, and ending cut-off work with an
    answer when it stops.

    SIGTERM is the platform asking for a drain: the listener stays open through
    the grace, so a load balancer sees /readyz go 503 and new requests get 503
    `drained` instead of connection refused; the drain's end stops the server
    (exit 0). A second SIGTERM, or SIGINT, stops it now (SIGINT exits 130, as
    an interrupted command does): what still runs is cut off, and its callers
    get 503 `drained`. Either way the process exits whatever user threads do
    (runtime/process.py); uvicorn's re-raising of the signal after its own
    shutdown is not used, because it would end the process with the signal's
    default action or a KeyboardInterrupt, and then wait for stuck threads.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        on_listening: Callable[[], None],
        on_sigterm: Callable[[], bool],
        on_stop: Callable[[], None],
    ) -> None:
        super().__init__(config)
        self._on_listening = on_listening
        self._on_sigterm = on_sigterm
        self._on_stop = on_stop
        self._loop: asyncio.AbstractEventLoop | None = None
        self.interrupted = False
        self.startup_failed = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            await super().startup(sockets)
        except SystemExit:
            # uvicorn's way of failing to start (the port taken, the lifespan failed,
            # logged already): its exit code, 3, is Thaw's invalid-input. This server
            # stops instead, and `serve` exits 1, as any command that failed.
            self.startup_failed = True
            self.should_exit = True
            return
        if not self.should_exit:
            self._on_listening()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop = self._loop
        if loop is None:  # not started yet: as uvicorn does
            super().handle_exit(sig, frame)
            return
        if sig == signal.SIGINT:
            self.interrupted = True
        # A signal handler may only hand work to the loop, never run it.
        loop.call_soon_threadsafe(self._signalled, sig)

    def _signalled(self, sig: int) -> None:
        if sig == signal.SIGTERM and not self.should_exit and self._on_sigterm():
            return  # a drain began: serve on through its grace
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # Cut off what still runs, now, while its connections are open: handler
        # work (after a drain, none is left), then every request still running (a
        # body still arriving, a long-poll). Each caller gets 503 `drained`
        # (runtime.http.edge.Edge), where uvicorn would cancel them a second later
        # with an error logged and a text/plain 500 each.
        self._on_stop()
        for task in list(self.server_state.tasks):
            task.cancel()
        await super().shutdown(sockets)


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB"


def serving_line(instance: Instance, url: str) -> str:
    """What this server serves, said once it listens: version, handlers, bundles,
    device and memory budget. Neither is resolved here (that imports torch, which
    the first load does): an unset one is said to come with the first load."""
    settings = instance.settings
    version = __version__
    handlers = instance.handler_names()
    bundles = instance.bundle_names()
    pinned = f" (prewarm {', '.join(settings.prewarm)})" if settings.prewarm else ""
    device = settings.device or "cuda if there is one, else cpu (resolved at the first load)"
    budget = (
        _gib(settings.memory_budget)
        if settings.memory_budget
        else "90 % of free GPU memory, else 80 % of the memory limit (at the first load)"
    )
    broken = "; ".join(b.summary() for b in instance.registry.broken)
    not_served = f" (modules that failed to import, not served: {broken})" if broken else ""
    return (
        f"thaw {version} serving {url}: {len(handlers)} handlers ({', '.join(handlers)})"
        f"{not_served}; "
        f"{len(bundles)} bundles ({', '.join(bundles)}){pinned}; device {device}; "
        f"memory budget {budget}"
    )


def serve(host: str = "127.0.0.1", port: int = 8080, insecure: bool = False) -> int:
    settings = Settings.from_env()
    configure_logging(settings.log_level)
    host_memory.configure(settings)
    # The plain keys live in the settings now; handler code must not read them.
    forget_secrets()
    if not is_loopback(host) and not settings.auth and not insecure:
        raise ConfigError(
            f"refusing to listen on {host} without API keys: set THAW_API_KEYS or "
            "THAW_API_KEYS_FILE, or pass --insecure to expose an unauthenticated endpoint"
        )
    # Before listening: a handler tree with nothing that imports, a bundle source or
    # job store URL that does not parse, is one error line and exit 1 (thaw's), not a
    # failed lifespan's traceback; a partly broken handler tree is served.
    registry = discover(settings.handlers)
    instance = Instance.create(settings, registry)
    app = create_app(settings, instance, defer_background=True)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=settings.log_level.lower(),
        access_log=False,
        lifespan="on",
        log_config=None,
        # The drain already gave in-flight work its grace; what is left is closing.
        timeout_graceful_shutdown=1,
        http=_h11_protocol(settings.body_timeout_s),
        timeout_keep_alive=5,
        h11_max_incomplete_event_size=64 * 1024,
        # No `Server: uvicorn`: an answer does not name the software behind it (a
        # scanner's first question), and each header is h11 work on every answer.
        server_header=False,
        # No X-Forwarded-* rewrite of the client address: nothing in Thaw reads it (the
        # access log names no address), and uvicorn's middleware for it is one more
        # ASGI layer, its header scan and frame, on every request.
        proxy_headers=False,
    )
    failed: list[Exception] = []

    def request_exit() -> None:
        server.should_exit = True

    def start_failed(exc: Exception) -> None:
        # The job store could not be opened: exit non-zero, as if it had failed
        # before listening (it is opened after, so /healthz does not wait on it).
        failed.append(exc)
        request_exit()

    def on_listening() -> None:
        instance = app.state.instance
        instance.exit_hook = request_exit
        instance.start_background(on_error=start_failed)
        # The port bound, which `--port 0` leaves to the OS.
        bound = port or server.servers[0].sockets[0].getsockname()[1]
        url = f"http://[{host}]:{bound}" if ":" in host else f"http://{host}:{bound}"
        logging.getLogger("thaw.server").info(serving_line(instance, url))

    def on_sigterm() -> bool:
        instance = getattr(app.state, "instance", None)
        return instance is not None and instance.begin_drain("SIGTERM")

    def on_stop() -> None:
        app.state.stopping = True
        instance = getattr(app.state, "instance", None)
        if instance is None:
            return
        # Readiness off and no new work, if no drain had begun (SIGINT).
        instance.begin_drain("shutdown")
        # Work still in flight is cut off as a drain's grace ends: a waiting
        # caller gets 503 `drained`, a job is recorded drained (retryable).
        instance.abort()

    server = _Server(config, on_listening=on_listening, on_sigterm=on_sigterm, on_stop=on_stop)
    process.run(server.serve())
    # Wedged: exit non-zero, so the platform counts it a failure and replaces it.
    wedged = instance.wedged
    code = 1 if failed or wedged or server.startup_failed else 130 if server.interrupted else 0
    process.exit_past_stuck_threads(code)
    logging.getLogger("thaw.server").info("stopped")
    return code


if __name__ == "__main__":
    sys.exit(serve())
