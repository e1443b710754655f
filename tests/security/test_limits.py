"""Input limits: every violation is a 4xx problem+json naming the limit, except where
uvicorn answers before the app (documented in docs/security.md), and the server
stays up. The app's own limits are checked in-process; what depends on uvicorn's
handling of the connection (a header block in one read or in pieces, idle
connections) against a real `thaw serve`."""

from __future__ import annotations

import concurrent.futures
import math
import socket
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.inproc import serving
from tests.security.conftest import PROBLEM, ROOT, Launch, light_settings
from tests.support import SAFETY_S, ServerProcess

MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
async def app(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[httpx.AsyncClient]:
    settings = light_settings(tmp_path_factory.mktemp("server"), max_body_bytes=MAX_BODY)
    async with serving(settings) as served:
        yield served.client


@pytest.fixture(scope="module")
def server(launch_module: Launch) -> ServerProcess:
    return launch_module(THAW_MAX_BODY_BYTES=str(MAX_BODY))


def problem(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    body: dict[str, object] = response.json()
    assert body["status"] == status
    return body


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.anyio
async def test_body_over_the_limit_is_413_before_it_is_read(app: httpx.AsyncClient) -> None:
    body = problem(await app.post("/invoke/echo", content=b" " * (MAX_BODY + 1)), 413)
    assert f"THAW_MAX_BODY_BYTES={MAX_BODY}" in str(body["detail"])
    assert body["limit_bytes"] == MAX_BODY


@pytest.mark.anyio
async def test_chunked_body_over_the_limit_is_413(app: httpx.AsyncClient) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(MAX_BODY // 4096 + 2):
            yield b" " * 4096

    response = await app.post("/invoke/echo", content=chunks())
    assert "THAW_MAX_BODY_BYTES" in str(problem(response, 413)["detail"])


@pytest.mark.anyio
async def test_nesting_at_the_limit_is_served_one_deeper_is_400_naming_it(
    app: httpx.AsyncClient,
) -> None:
    ok = await app.post("/invoke/echo", content=nested(64))
    assert ok.status_code == 200 and ok.content == nested(64)
    body = problem(await app.post("/invoke/echo", content=nested(65)), 400)
    assert "THAW_MAX_JSON_DEPTH=64" in str(body["detail"]) and body["max_json_depth"] == 64
    deep_object = b'{"a":' * 65 + b"1" + b"}" * 65
    problem(await app.post("/invoke/echo", content=deep_object), 400)


@pytest.mark.anyio
async def test_brackets_inside_strings_are_not_nesting(app: httpx.AsyncClient) -> None:
    event = {"text": "[" * 500 + "{" * 500, "list": [[1], [2]]}
    response = await app.post("/invoke/echo", json=event)
    assert response.status_code == 200 and response.json() == event


@pytest.mark.anyio
async def test_wide_batches_are_served_and_escapes_hide_no_depth(app: httpx.AsyncClient) -> None:
    """Past 64 opening brackets the depth is read from the text
    (runtime/wire/nesting.py): a wide batch is served whole, and a chain one
    level too deep between strings of escaped quotes is still refused."""
    batch = {"vectors": [[0.25] * 8 for _ in range(300)], "pairs": [[1, 2]] * 300}
    response = await app.post("/invoke/echo", json=batch)
    assert response.status_code == 200 and response.json() == batch
    hidden = b'["\\"", ' + nested(64) + b', "\\"[]"]'
    body = problem(await app.post("/invoke/echo", content=hidden), 400)
    assert body["max_json_depth"] == 64


@pytest.mark.anyio
async def test_nesting_past_orjsons_own_limit_is_invalid_json(app: httpx.AsyncClient) -> None:
    body = problem(await app.post("/invoke/echo", content=nested(5000)), 400)
    assert str(body["type"]).endswith("/invalid-json")


@pytest.mark.parametrize("content", [b"{", b"\xff\xfe", b'{"a": NaN}', b"[1,]", b"1e99999"])
@pytest.mark.anyio
async def test_bad_json_is_400(app: httpx.AsyncClient, content: bytes) -> None:
    body = problem(await app.post("/invoke/echo", content=content), 400)
    assert str(body["type"]).endswith("/invalid-json")


@pytest.mark.parametrize("prefer", ["wait=abc", "wait=-1", "wait=inf"])
@pytest.mark.anyio
async def test_bad_prefer_is_400(app: httpx.AsyncClient, prefer: str) -> None:
    response = await app.post("/invoke/echo", json={}, headers={"Prefer": prefer})
    assert str(problem(response, 400)["type"]).endswith("/invalid-prefer")


@pytest.mark.anyio
async def test_unknown_handler_is_404(app: httpx.AsyncClient) -> None:
    response = await app.post("/invoke/no-such-handler", json={})
    assert str(problem(response, 404)["type"]).endswith("/unknown-handler")


def raw_request(server: ServerProcess, head: bytes, timeout_s: float = 10.0) -> bytes:
    """Send `head` in one write and return everything the server sends before closing."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout_s) as sock:
        sock.sendall(head)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
            if b"\r\n\r\n" in received and received.endswith(b"}"):
                break
        return received


def test_100_kb_header_in_one_burst_is_400_naming_the_limit(server: ServerProcess) -> None:
    # Arriving whole in one read, it passes uvicorn's h11 limit; the app refuses it.
    head = b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n"
    status_line, _, rest = raw_request(server, head).partition(b"\r\n")
    assert status_line == b"HTTP/1.1 400 Bad Request"
    assert b"content-type: application/problem+json" in rest.lower()
    assert b"65536-byte limit" in rest
    many = b"".join(b"X-H%d: %s\r\n" % (i, b"b" * 90) for i in range(1100))
    reply = raw_request(server, b"GET /healthz HTTP/1.1\r\nHost: t\r\n" + many + b"\r\n")
    assert reply.startswith(b"HTTP/1.1 400 ")
    assert httpx.get(f"{server.url}/healthz").status_code == 200


def test_100_kb_header_trickled_is_refused_by_uvicorn(server: ServerProcess) -> None:
    # Arriving in pieces, h11 stops buffering at 64 KiB: uvicorn answers itself,
    # in text/plain, and closes the connection.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: ")
        try:
            for _ in range(10):
                sock.sendall(b"a" * 10_000)
                time.sleep(0.02)
        except OSError:
            pass  # the server closed the connection mid-send: that is the refusal
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 400 Bad Request")
    assert b"Invalid HTTP request received." in reply
    assert httpx.get(f"{server.url}/healthz").status_code == 200


def seconds_until_closed(sock: socket.socket, limit_s: float) -> float:
    sock.settimeout(limit_s)
    started = time.monotonic()
    try:
        assert sock.recv(1) == b"", "the server sent something unasked"
    except TimeoutError:
        return math.inf
    return time.monotonic() - started


@pytest.fixture(scope="module")
def idle_closes(server: ServerProcess) -> dict[str, float]:
    """Seconds until the server closed an idle connection: one after a response, one
    that never sent anything. Both are watched at once, so the module waits once."""
    used = socket.create_connection(("127.0.0.1", server.port))
    fresh = socket.create_connection(("127.0.0.1", server.port))
    with used, fresh:
        used.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        received = b""
        while not received.endswith(b'{"status":"ok"}'):
            received += used.recv(65536)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            after_response = pool.submit(seconds_until_closed, used, SAFETY_S)
            never_used = pool.submit(seconds_until_closed, fresh, SAFETY_S)
            return {"after_response": after_response.result(), "never_used": never_used.result()}


def test_idle_keep_alive_connection_is_closed(idle_closes: dict[str, float]) -> None:
    idle_s = idle_closes["after_response"]
    # Closed by the server (not held until the test gave up), after its keep-alive
    # timeout (5 s) and not before: the upper side is load, not a property.
    assert 4.0 <= idle_s < math.inf, f"closed after {idle_s:.1f} s (timeout_keep_alive=5)"


def test_a_connection_that_never_sends_a_request_is_closed(
    idle_closes: dict[str, float],
) -> None:
    idle_s = idle_closes["never_used"]
    assert idle_s < math.inf, "a silent connection is held open"


@pytest.fixture(scope="module")
async def model_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[httpx.AsyncClient]:
    settings = light_settings(
        tmp_path_factory.mktemp("server"),
        bundle_source=str(ROOT / "bundles"),
        handlers=("handlers.tempconv",),
        prewarm=("tempconv",),
    )
    async with serving(settings, timeout_s=90) as served:
        yield served.client


@pytest.mark.parametrize(
    ("event", "message"),
    [
        ({}, "non-empty list"),
        ({"celsius": ["x"]}, "number"),
        ({"celsius": [0.0] * 4097}, "at most"),
    ],
)
@pytest.mark.anyio
async def test_handler_input_validation_is_400_naming_the_field(
    model_server: httpx.AsyncClient, event: dict[str, object], message: str
) -> None:
    response = await model_server.post(
        "/invoke/fahrenheit", json=event, headers={"Prefer": "wait=60"}
    )
    body = problem(response, 400)
    assert str(body["type"]).endswith("/invalid-input") and body["field"] == "celsius"
    assert message in str(body["detail"])
