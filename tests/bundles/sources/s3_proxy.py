"""A tiny HTTP proxy in front of moto that misbehaves on purpose, over a real socket.

It forwards every request to the upstream endpoint and relays the answer, but
a chosen GET can be *stalled* (a third of the body, then silence), *dead*
(headers, then silence) or *trickled* (the whole body in small pieces,
slowly). The S3 source under test sees a real slow or dead server; nothing in
it or in boto3 is patched.
"""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

# (method, path, attempt number for that path) -> "pass" | "stall" | "dead" | "trickle"
Plan = Callable[[str, str, int], str]
HOLD_S = 20.0  # how long a stalled response stays silent (ended early at teardown)
TRICKLE_BYTES = 16 * 1024
TRICKLE_EVERY_S = 0.2


@dataclass
class Seen:
    method: str
    path: str
    range: str | None


@dataclass
class ProxyState:
    upstream: str
    plan: Plan
    seen: list[Seen] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def gets(self, suffix: str) -> list[Seen]:
        with self.lock:
            return [s for s in self.seen if s.method == "GET" and s.path.endswith(suffix)]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self._relay()

    def do_PUT(self) -> None:
        self._relay()

    def _relay(self) -> None:
        state = self.server.state
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        with state.lock:
            state.seen.append(Seen(self.command, self.path, self.headers.get("Range")))
            attempt = sum(1 for s in state.seen if s.path == self.path and s.method == self.command)
        upstream = urlsplit(state.upstream)
        conn = http.client.HTTPConnection(upstream.hostname or "", upstream.port, timeout=30)
        try:
            conn.request(self.command, self.path, body=body, headers=dict(self.headers.items()))
            response = conn.getresponse()
            data = response.read()
            headers = response.getheaders()
        finally:
            conn.close()
        self.send_response(response.status)
        for name, value in headers:
            if name.lower() not in ("content-length", "transfer-encoding", "connection", "date"):
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        plan = state.plan(self.command, self.path, attempt)
        if plan in ("stall", "dead"):
            self.wfile.write(data[: len(data) // 3] if plan == "stall" else b"")
            self.wfile.flush()
            state.release.wait(HOLD_S)
            self.close_connection = True
        elif plan == "trickle":
            for start in range(0, len(data), TRICKLE_BYTES):
                self.wfile.write(data[start : start + TRICKLE_BYTES])
                self.wfile.flush()
                time.sleep(TRICKLE_EVERY_S)
        else:
            self.wfile.write(data)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, state: ProxyState) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.state = state


@contextmanager
def misbehaving_proxy(upstream: str, plan: Plan) -> Iterator[tuple[str, ProxyState]]:
    """Serve the proxy on 127.0.0.1 for the block; yields (url, state) and stops it after."""
    state = ProxyState(upstream, plan)
    server = _Server(state)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        state.release.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
