"""Slow and broken clients against a real `thaw serve` process, over real sockets:
a body trickled, a body short of its Content-Length, a client gone mid-body,
a body nobody reads trickled on, and many partial bodies past the buffer cap.

Settings are small (THAW_BODY_TIMEOUT_S=1, a 256 KiB cap) so outcomes come
quickly; the tests assert outcomes and order, never durations.
"""

from __future__ import annotations

import json
import os
import select
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import ServerProcess

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)

PROBLEM = "application/problem+json"
CAP = 256 * 1024
# Far longer than any outcome below takes: reaching it is a failure, not a figure.
PATIENCE_S = 60.0


def server_env(root: Path, **env: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("THAW_", "AWS_LAMBDA"))}
    return {
        **clean,
        "THAW_CACHE_DIR": str(root / "cache"),
        "THAW_STATE_DIR": str(root / "state"),
        "THAW_JOB_STORE": f"sqlite:///{root / 'jobs.sqlite3'}",
        "THAW_HANDLERS": "handlers.echo",
        "THAW_LOG_LEVEL": "INFO",
        "PYTHONUNBUFFERED": "1",
        **env,
    }


@pytest.fixture(scope="module")
def impatient(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A body must arrive within 1 s."""
    root = tmp_path_factory.mktemp("impatient")
    with ServerProcess(server_env(root, THAW_BODY_TIMEOUT_S="1")) as server:
        yield server


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Bodies may take a minute, and hold 256 KiB between them (one body about half)."""
    root = tmp_path_factory.mktemp("capped")
    env = server_env(
        root,
        THAW_BODY_TIMEOUT_S="60",
        THAW_MAX_BUFFERED_BYTES=str(CAP),
        THAW_MAX_BODY_BYTES=str(CAP // 2 + 4096),
    )
    with ServerProcess(env) as server:
        yield server


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    closed: bool | None  # the server closed the connection after it (None: not looked at)

    def problem(self) -> dict[str, Any]:
        assert self.headers["content-type"] == PROBLEM, self
        body: dict[str, Any] = json.loads(self.body)
        assert body["status"] == self.status
        return body


def connect(server: ServerProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=PATIENCE_S)


def head(path: str, length: int | None, method: str = "POST") -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (
        f"{method} {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"{framing}\r\n\r\n"
    ).encode()


def answered(sock: socket.socket, wait_s: float = 0.0) -> bool:
    return bool(select.select([sock], [], [], wait_s)[0])


def read_reply(sock: socket.socket, *, see_if_closed: bool = True) -> Reply:
    """The server's one reply, and whether it then closed the connection (a kept-alive
    one is known open only once the keep-alive timeout closes it: a test that does
    not ask passes `see_if_closed=False`)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed without a reply: {data!r}"
        data += chunk
    raw_head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = raw_head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers["content-length"])
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed mid-reply"
        body += chunk
    if not see_if_closed:
        return Reply(int(status_line.split()[1]), headers, body, None)
    try:
        closed = sock.recv(1) == b""
    except ConnectionResetError:
        closed = True
    except TimeoutError:
        closed = False
    return Reply(int(status_line.split()[1]), headers, body, closed)


def trickle_until_answered(sock: socket.socket, pieces: list[bytes]) -> int:
    """Send `pieces` one at a time, a tenth of a second apart, until the server
    answers; how many were sent."""
    for sent, piece in enumerate(pieces):
        if answered(sock, 0.1):
            return sent
        try:
            sock.sendall(piece)
        except OSError:  # closed under us: the answer is there to read
            return sent
    raise AssertionError(f"no answer after all {len(pieces)} pieces")


def log_entries(server: ServerProcess) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for line in server.log_path.read_text(errors="replace").splitlines()
        if line.startswith("{")
    ]


def assert_no_error_logged(server: ServerProcess) -> None:
    for entry in log_entries(server):
        assert entry["level"] not in ("error", "critical"), entry
        assert "exc_type" not in entry, entry
    assert "Traceback" not in server.log_path.read_text(errors="replace")


def assert_still_serves(server: ServerProcess) -> None:
    response = httpx.post(f"{server.url}/invoke/echo", json={"still": "serving"})
    assert response.status_code == 200 and response.json() == {"still": "serving"}


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_trickled_body_is_408_and_the_connection_closed(
    impatient: ServerProcess, framing: str
) -> None:
    length = 4096 if framing == "content-length" else None
    # One byte per piece; chunked, each byte is a chunk of its own.
    pieces = [b" " if length else b"1\r\n \r\n"] * int(PATIENCE_S * 10)
    with connect(impatient) as sock:
        sock.sendall(head("/invoke/echo", length))
        sent = trickle_until_answered(sock, pieces)
        reply = read_reply(sock)
    assert sent < len(pieces)
    assert reply.status == 408
    problem = reply.problem()
    assert problem["type"].endswith("/request-timeout")
    assert "THAW_BODY_TIMEOUT_S" in problem["detail"]
    assert reply.headers["connection"] == "close" and reply.closed
    assert_still_serves(impatient)


def test_a_body_short_of_its_content_length_is_408_and_the_connection_closed(
    impatient: ServerProcess,
) -> None:
    with connect(impatient) as sock:
        sock.sendall(head("/invoke/echo", 100) + b'{"x": 1')
        # Nothing more is sent: the server must answer on its own.
        assert answered(sock, PATIENCE_S)
        reply = read_reply(sock)
    assert reply.status == 408 and reply.problem()["type"].endswith("/request-timeout")
    assert reply.closed
    assert_still_serves(impatient)


def test_a_client_gone_mid_body_is_logged_at_info_without_a_traceback(
    impatient: ServerProcess,
) -> None:
    def disconnects() -> list[dict[str, Any]]:
        return [e for e in log_entries(impatient) if "disconnected" in e["msg"]]

    before = len(disconnects())
    with connect(impatient) as sock:
        sock.sendall(head("/invoke/echo", 1000) + b'{"x": ')
        # The request reached the app before the client went away.
        assert httpx.get(f"{impatient.url}/healthz").status_code == 200
    deadline = time.monotonic() + PATIENCE_S
    while len(disconnects()) == before:
        assert time.monotonic() < deadline, "the disconnect was never logged"
        time.sleep(0.05)
    assert [e["level"] for e in disconnects()[before:]] == ["info"]
    assert_no_error_logged(impatient)
    assert_still_serves(impatient)


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("POST", "/no/such/route", 404), ("PUT", "/invoke/echo", 405)],
)
def test_a_body_nobody_reads_cannot_be_trickled_forever(
    impatient: ServerProcess, method: str, path: str, status: int
) -> None:
    # Answered before its body is read; the rest is discarded as it arrives,
    # and must arrive within THAW_BODY_TIMEOUT_S too.
    with connect(impatient) as sock:
        sock.sendall(head(path, 100_000, method) + b"{")
        assert answered(sock, PATIENCE_S)
        data = sock.recv(65536)
        assert data.startswith(f"HTTP/1.1 {status} ".encode()), data
        closed = False
        for _ in range(int(PATIENCE_S * 10)):
            try:
                sock.sendall(b" ")
                if answered(sock, 0.1) and sock.recv(65536) == b"":
                    closed = True
                    break
            except OSError:
                closed = True
                break
    assert closed, "the connection was held while the client trickled"
    assert_still_serves(impatient)


def test_a_trickled_request_head_cannot_hold_the_connection(impatient: ServerProcess) -> None:
    # A byte per tenth of a second would take a minute: the keep-alive timeout
    # (5 s) ends the connection first, with no request to answer.
    head = b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Pad: " + b"a" * 600 + b"\r\n\r\n"
    with connect(impatient) as sock:
        sent = trickle_until_answered(sock, [bytes([byte]) for byte in head])
        try:
            reply = sock.recv(65536)
        except ConnectionResetError:
            reply = b""
    assert sent < len(head) and reply == b""
    assert_still_serves(impatient)


def test_a_body_in_pieces_within_its_time_is_served(capped: ServerProcess) -> None:
    event = {"pieces": ["x" * 1000] * 20}
    body = json.dumps(event).encode()
    with connect(capped) as sock:
        sock.sendall(head("/invoke/echo", len(body)))
        for start in range(0, len(body), 2000):
            sock.sendall(body[start : start + 2000])
            time.sleep(0.01)
        reply = read_reply(sock, see_if_closed=False) if answered(sock, PATIENCE_S) else None
    assert reply is not None and reply.status == 200
    assert json.loads(reply.body) == event


@pytest.mark.parametrize("partial", [60_000, 64 * 1024], ids=["60KB", "64KiB-fills-exactly"])
def test_partial_bodies_past_the_buffer_cap_are_503_and_the_bytes_come_back(
    capped: ServerProcess, partial: int
) -> None:
    declared, clients = partial + 40_000, 8  # 8 partial bodies, twice the cap between them
    socks = [connect(capped) for _ in range(clients)]
    replies: dict[int, Reply] = {}
    try:
        for sock in socks:
            sock.sendall(head("/invoke/echo", declared) + b" " * partial)
        # At most CAP // partial bodies fit; every other one is refused.
        must_refuse = clients - CAP // partial
        deadline = time.monotonic() + PATIENCE_S
        while len(replies) < must_refuse:
            assert time.monotonic() < deadline, f"only {len(replies)} refused"
            waiting = [s for i, s in enumerate(socks) if i not in replies]
            for sock in select.select(waiting, [], [], 0.5)[0]:
                replies[socks.index(sock)] = read_reply(sock)
        for reply in replies.values():
            assert reply.status == 503
            problem = reply.problem()
            assert problem["type"].endswith("/overloaded")
            assert "THAW_MAX_BUFFERED_BYTES" in problem["detail"]
            assert int(reply.headers["retry-after"]) >= 1
            assert reply.closed
        held = [s for i, s in enumerate(socks) if i not in replies]
        assert held and len(held) * partial <= CAP
        # However full they left it, a normal request is still served beside them.
        assert_still_serves(capped)
    finally:
        for sock in socks:
            sock.close()  # the held ones go away mid-body
    # Their bytes come back: a body they left no room for is served.
    big = {"blob": "x" * (CAP // 2)}
    assert len(json.dumps(big)) > CAP - len(held) * partial
    deadline = time.monotonic() + PATIENCE_S
    while True:
        response = httpx.post(f"{capped.url}/invoke/echo", json=big, timeout=PATIENCE_S)
        if response.status_code != 503:
            break
        assert time.monotonic() < deadline, "the held bodies' bytes never came back"
        time.sleep(0.05)
    assert response.status_code == 200 and response.json() == big
    assert_no_error_logged(capped)
