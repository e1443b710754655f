"""`thaw serve`: the HTTP app on uvicorn, with drain wired to process exit."""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import logging
import signal
import socket
import sys
from collections.abc import Callable

import uvicorn

from runtime import process
from runtime.errors import ConfigError
from runtime.http.app import create_app
from runtime.http.connections import Connections
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


class Outcome(enum.Enum):
    """How a server run ended: its exit code."""

    STOPPED = 0  # asked to stop (a drain's end, SIGTERM past a drain, a second SIGTERM)
    FAILED = 1  # it could not start (the lifespan failed), or its job store could not open
    INTERRUPTED = 130  # SIGINT, as an interrupted command


# How often a starting server is asked whether it listens (uvicorn says it only
# through `Server.started`); background loads and the serving line wait on it.
_STARTED_POLL_S = 0.001


async def run_server(
    server: uvicorn.Server,
    sock: socket.socket,
    on_listening: Callable[[], None],
    on_signal: Callable[[int], None],
) -> bool:
    """Serve `server` on `sock` until it stops; False if it never started.

    Once it listens, `on_listening` runs and SIGINT and SIGTERM are this
    caller's (`on_signal`, on the loop): uvicorn's own handling, installed for
    the run by `serve()`, would stop the server on either and raise the signal
    again after its shutdown, ending the process by the signal's default action
    or a KeyboardInterrupt, then waiting for stuck threads (runtime/process.py).
    Before it listens, a signal is uvicorn's.
    """
    loop = asyncio.get_running_loop()
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(_STARTED_POLL_S)
    handled: tuple[signal.Signals, ...] = ()
    if server.started and not server.should_exit:
        handled = (signal.SIGINT, signal.SIGTERM)
        for sig in handled:
            loop.add_signal_handler(sig, on_signal, sig)
        on_listening()
    try:
        await serving
    except SystemExit:
        # uvicorn's way of failing to start (the lifespan failed, logged already):
        # its exit code, 3, is Thaw's invalid-input; the caller says what it is.
        return False
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
    return server.started


def listen(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A TCP socket listening on `host:port` (0: a port the OS picks), or ConfigError.

    It listens before the server runs: a client that connects while the server
    still starts waits in the backlog for its answer, rather than being refused."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that say
    # so, and without it every response waits ~40 ms on a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    return sock


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
    """Serve until stopped; the exit code.

    SIGTERM is the platform asking for a drain: the listener stays open through
    the grace, so a load balancer sees /readyz go 503 and new requests get 503
    `drained` instead of connection refused; the drain's end stops the server
    (exit 0). A second SIGTERM, or SIGINT, stops it now (SIGINT exits 130, as
    an interrupted command does). Stopping cuts off what still runs, while its
    connections are open: handler work (after a drain, none is left), then
    every request still running (a body still arriving, a long-poll); each
    caller gets 503 `drained` (runtime.http.edge.Edge). Either way the process
    exits whatever user threads do (runtime/process.py).
    """
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
    # job store URL that does not parse, a port taken, is one error line and exit 1
    # (thaw's), not a failed lifespan's traceback; a partly broken handler tree is served.
    registry = discover(settings.handlers)
    instance = Instance.create(settings, registry)
    app = create_app(settings, instance, defer_background=True)
    sock = listen(host, port)
    # The port bound, which `--port 0` leaves to the OS.
    bound = sock.getsockname()[1]
    url = f"http://[{host}]:{bound}" if ":" in host else f"http://{host}:{bound}"
    keep_alive_s = 5
    connections = Connections(keep_alive_s)
    config = uvicorn.Config(
        connections.app(app),
        log_level=settings.log_level.lower(),
        access_log=False,
        lifespan="on",
        log_config=None,
        # What still runs when it stops is cut off first (`stop`): what is left is closing.
        timeout_graceful_shutdown=1,
        # uvicorn's h11 protocol, inside the connection adapter (connections.py).
        http=connections.protocol(),
        timeout_keep_alive=keep_alive_s,
        h11_max_incomplete_event_size=64 * 1024,
        # No `Server: uvicorn`: an answer does not name the software behind it (a
        # scanner's first question), and each header is h11 work on every answer.
        server_header=False,
        # No X-Forwarded-* rewrite of the client address: nothing in Thaw reads it (the
        # access log names no address), and uvicorn's middleware for it is one more
        # ASGI layer, its header scan and frame, on every request.
        proxy_headers=False,
    )
    server = uvicorn.Server(config)
    outcome = Outcome.STOPPED

    def stop() -> None:
        if connections.stopped:
            return
        app.state.stopping = True
        # Readiness off and no new work, if no drain had begun (SIGINT).
        instance.begin_drain("shutdown")
        # Work still in flight is cut off as a drain's grace ends: a waiting
        # caller gets 503 `drained`, a job is recorded drained (retryable).
        instance.abort()
        connections.stop()
        server.should_exit = True

    def start_failed(exc: Exception) -> None:
        # The job store could not be opened: exit non-zero, as if it had failed
        # before listening (it is opened after, so /healthz does not wait on it).
        nonlocal outcome
        outcome = Outcome.FAILED
        stop()

    def on_listening() -> None:
        instance.exit_hook = stop
        instance.start_background(on_error=start_failed)
        logging.getLogger("thaw.server").info(serving_line(instance, url))

    def on_signal(sig: int) -> None:
        nonlocal outcome
        if sig == signal.SIGINT and outcome is Outcome.STOPPED:
            outcome = Outcome.INTERRUPTED
        if sig == signal.SIGTERM and not connections.stopped and instance.begin_drain("SIGTERM"):
            return  # a drain began: serve on through its grace
        stop()

    started = process.run(run_server(server, sock, on_listening, on_signal))
    sock.close()
    if not started:
        outcome = Outcome.FAILED
    # Wedged: exit non-zero, so the platform counts it a failure and replaces it.
    code = Outcome.FAILED.value if instance.wedged else outcome.value
    process.exit_past_stuck_threads(code)
    logging.getLogger("thaw.server").info("stopped")
    return code


if __name__ == "__main__":
    sys.exit(serve())
