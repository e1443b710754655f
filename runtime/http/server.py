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

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from runtime import process
from runtime.errors import ConfigError
from runtime.http.app import create_app
from runtime.logs import configure_logging
from runtime.settings import Settings


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _H11Protocol(H11Protocol):
    """uvicorn's h11 protocol, also closing connections that never send a request.

    uvicorn arms its keep-alive timer only after a first response, so a client
    that connects and stays silent would hold a connection forever. Naming the
    class also pins h11, whose header-size limit we rely on (httptools has none).
    """

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )


class _Server(uvicorn.Server):
    """uvicorn, telling us when it listens (background loads start after that), and
    draining on SIGTERM while it keeps serving.

    SIGTERM is the platform asking for a drain: the listener stays open through
    the grace, so a load balancer sees /readyz go 503 and new requests get 503
    `drained` instead of connection refused; the drain's end stops the server
    (exit 0). A second SIGTERM, or SIGINT, stops it at once as uvicorn does.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        on_listening: Callable[[], None],
        on_sigterm: Callable[[], bool],
    ) -> None:
        super().__init__(config)
        self._on_listening = on_listening
        self._on_sigterm = on_sigterm
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if not self.should_exit:
            self._on_listening()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop = self._loop
        if sig == signal.SIGTERM and loop is not None and not self.should_exit:
            # A signal handler may only hand work to the loop, never run it.
            loop.call_soon_threadsafe(self._sigterm)
            return
        super().handle_exit(sig, frame)

    def _sigterm(self) -> None:
        if not self._on_sigterm():  # a drain is under way already: stop now
            self.should_exit = True


def serve(host: str = "127.0.0.1", port: int = 8080, insecure: bool = False) -> int:
    settings = Settings.from_env()
    configure_logging(settings.log_level)
    if not is_loopback(host) and not (settings.api_keys or settings.api_keys_file) and not insecure:
        raise ConfigError(
            f"refusing to listen on {host} without API keys: set THAW_API_KEYS or "
            "THAW_API_KEYS_FILE, or pass --insecure to expose an unauthenticated endpoint"
        )
    app = create_app(settings, defer_background=True)
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
        http=_H11Protocol,
        timeout_keep_alive=5,
        h11_max_incomplete_event_size=64 * 1024,
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

    def on_sigterm() -> bool:
        instance = getattr(app.state, "instance", None)
        return instance is not None and instance.begin_drain("SIGTERM")

    server = _Server(config, on_listening=on_listening, on_sigterm=on_sigterm)
    process.run(server.serve())
    code = 1 if failed else 0
    process.exit_past_stuck_threads(code)
    logging.getLogger("thaw.server").info("stopped")
    return code


if __name__ == "__main__":
    sys.exit(serve())
