"""Shutdown against a real `thaw serve` process: a drain past its grace, SIGTERM
while user code never returns, serving through the grace, and stopping now.

Handlers that never return (tests.handlers.hangs) block for a day: a process
that exits within a test's generous wait did not wait for them. No test here
bounds a duration; the figures are in bench/experiments/shutdown.py.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from runtime.settings import Settings
from tests.inproc import answer_once
from tests.support import ServerProcess

PROBLEM = "application/problem+json"
HANDLERS = "tests.handlers.hangs,handlers.echo"
# Far longer than any wait below: reaching the end of one is a failure, not a figure.
PATIENCE_S = 60.0


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


def assert_drained(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["content-type"] == PROBLEM
    assert response.json()["type"].endswith("/drained")


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


def entered(server: ServerProcess) -> int:
    with server.client() as client:
        count: int = client.post("/invoke/entered_count", json={}).json()["entered"]
        return count


def call(
    server: ServerProcess, handler: str, event: dict[str, Any] | None = None
) -> httpx.Response:
    """One invocation on a connection of its own, as separate callers make them."""
    with httpx.Client(base_url=server.url, timeout=PATIENCE_S) as client:
        return client.post(f"/invoke/{handler}", json=event or {}, headers={"Prefer": "wait=50"})


def readiness_off(server: ServerProcess) -> bool:
    return httpx.get(f"{server.url}/readyz", timeout=PATIENCE_S).status_code == 503


def exit_code(server: ServerProcess) -> int:
    assert server.proc is not None
    return server.proc.wait(PATIENCE_S)


@pytest.mark.parametrize("stop", ["drain", "sigterm"])
def test_work_cut_off_by_the_grace_is_503_drained_and_its_job_retryable(
    serve: Any, stop: str
) -> None:
    server: ServerProcess = serve(THAW_HANDLERS=HANDLERS, THAW_DRAIN_GRACE_S="0.5")
    with server.client() as client:
        job = client.post("/invoke/hangs_async", json={}, headers={"Prefer": "respond-async"})
        assert job.status_code == 202
    callers = 20
    with concurrent.futures.ThreadPoolExecutor(callers) as pool:
        # Sync handlers on threads that never end, and async ones on the loop.
        handlers = ["hangs" if i % 2 else "hangs_async" for i in range(callers)]
        pending = [pool.submit(call, server, name) for name in handlers]
        wait_until(lambda: entered(server) == callers + 1, "every caller's handler ran")
        if stop == "drain":
            assert httpx.post(f"{server.url}/drain").status_code == 202
        else:
            assert server.proc is not None
            server.proc.send_signal(signal.SIGTERM)
        responses = [future.result() for future in pending]
    for response in responses:
        assert_drained(response)
    assert exit_code(server) == 0
    assert_no_error_logged(server)
    # Restarted on the same state (in-process: the record is the point, not the process).
    final = answer_once(Settings.from_env(server.env), "GET", f"/jobs/{job.json()['id']}").json()
    assert final["status"] == "failed"
    assert final["error"]["type"] == "drained" and final["error"]["retryable"] is True


def test_sigterm_exits_zero_while_a_sync_handler_never_returns(serve: Any) -> None:
    server: ServerProcess = serve(THAW_HANDLERS=HANDLERS, THAW_DRAIN_GRACE_S="1")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stuck = pool.submit(call, server, "hangs")
        wait_until(lambda: entered(server) == 1, "the handler ran")
        assert server.proc is not None
        server.proc.send_signal(signal.SIGTERM)
        assert_drained(stuck.result())
    # The handler's thread sleeps for a day: the process ended without it.
    assert exit_code(server) == 0
    warnings = [e["msg"] for e in log_entries(server) if e["logger"] == "thaw.process"]
    assert any("still running user code" in msg for msg in warnings), warnings
    assert_no_error_logged(server)


def test_sigterm_keeps_serving_through_the_grace_then_exits_zero(serve: Any) -> None:
    # The grace outlasts the checks below: a handler that never returns keeps
    # the drain going until the grace ends.
    server: ServerProcess = serve(THAW_HANDLERS=HANDLERS, THAW_DRAIN_GRACE_S="5")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stuck = pool.submit(call, server, "hangs")
        wait_until(lambda: entered(server) == 1, "the handler ran")
        assert httpx.get(f"{server.url}/readyz").status_code == 200
        assert server.proc is not None
        server.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: readiness_off(server), "readiness went off")
        # Each on a new connection: the listener is still open.
        refused = httpx.post(f"{server.url}/invoke/echo", json={"x": 1})
        assert_drained(refused)
        ready = httpx.get(f"{server.url}/readyz")
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        assert httpx.get(f"{server.url}/healthz").status_code == 200
        assert server.proc.poll() is None
        assert_drained(stuck.result())
    assert exit_code(server) == 0
    assert_no_error_logged(server)


@pytest.mark.parametrize(
    ("signals", "code"),
    [([signal.SIGTERM, signal.SIGTERM], 0), ([signal.SIGINT], 130)],
    ids=["second-sigterm", "sigint"],
)
def test_a_second_sigterm_or_sigint_stops_now(
    serve: Any, signals: list[signal.Signals], code: int
) -> None:
    # A grace far past the test's patience: exiting at all means it was not waited for.
    server: ServerProcess = serve(THAW_HANDLERS=HANDLERS, THAW_DRAIN_GRACE_S="3600")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        stuck = [pool.submit(call, server, name) for name in ("hangs", "hangs_async")]
        wait_until(lambda: entered(server) == 2, "the handlers ran")
        assert server.proc is not None
        for index, sig in enumerate(signals):
            if index:
                wait_until(lambda: readiness_off(server), "the first SIGTERM began a drain")
            server.proc.send_signal(sig)
        for future in stuck:
            assert_drained(future.result())
    assert exit_code(server) == code
    assert_no_error_logged(server)


def test_a_request_still_arriving_when_the_server_stops_gets_503_drained(serve: Any) -> None:
    # Its body would be given a minute: the server stops first, and answers it.
    server: ServerProcess = serve(
        THAW_HANDLERS=HANDLERS, THAW_DRAIN_GRACE_S="0.2", THAW_BODY_TIMEOUT_S="60"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=PATIENCE_S) as sock:
        sock.sendall(
            b"POST /invoke/echo HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n" + b'{"x": '
        )
        assert httpx.post(f"{server.url}/drain").status_code == 202
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 "), reply
    assert f"content-type: {PROBLEM}".encode() in head.lower()
    assert json.loads(body)["type"].endswith("/drained")
    assert exit_code(server) == 0
    assert_no_error_logged(server)
