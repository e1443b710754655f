"""The HTTP contract's edges against a real `thaw serve` (with API keys, on 127.0.0.1):
the job-submit route and its deprecated alias, X-Request-Id on every answer,
`Vary: Prefer`, `respond-async, wait=S`, the access log, the request id in every
line about a request and its job, and the request metrics."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import ServerProcess

KEY = "contract-key-5be0c3"
AUTH = {"Authorization": f"Bearer {KEY}"}
MARK = "PATH-MARK-0f3a9d"
HANDLERS = "handlers.echo,tests.handlers.raises,tests.handlers.sleepy"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("contract")
    (root / "bundles").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("THAW_", "AWS_LAMBDA"))}
    env.update(
        {
            "THAW_CACHE_DIR": str(root / "cache"),
            "THAW_STATE_DIR": str(root / "state"),
            "THAW_JOB_STORE": f"sqlite:///{root / 'jobs.sqlite3'}",
            "THAW_BUNDLE_SOURCE": str(root / "bundles"),
            "THAW_HANDLERS": HANDLERS,
            "THAW_API_KEYS": KEY,
            "THAW_LOG_LEVEL": "INFO",
            "PYTHONUNBUFFERED": "1",
        }
    )
    with ServerProcess(env) as started:
        yield started


@pytest.fixture
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as client:
        yield client


def log_lines(server: ServerProcess) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in server.log_path.read_text().splitlines() if line]


def wait_for_lines(
    server: ServerProcess, found: Callable[[list[dict[str, Any]]], bool], timeout_s: float = 20
) -> list[dict[str, Any]]:
    """The server's log lines, once `found` holds of them (they are written as work ends)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = log_lines(server)
        if found(lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def test_a_job_is_submitted_at_its_own_route_and_polled_at_its_location(
    client: httpx.Client,
) -> None:
    accepted = client.post("/handlers/echo/jobs", json={"n": 1})
    assert accepted.status_code == 202
    job = accepted.json()
    assert accepted.headers["location"] == f"/jobs/{job['id']}"
    assert "deprecation" not in accepted.headers
    done = client.get(accepted.headers["location"], params={"wait": 20}).json()
    assert done["status"] == "succeeded" and done["output"] == {"n": 1}
    assert client.post("/handlers/nope/jobs", json={}).json()["type"].endswith("/unknown-handler")


def test_the_old_submit_route_still_answers_marked_deprecated(client: httpx.Client) -> None:
    accepted = client.post("/jobs/echo", json={"old": True})
    assert accepted.status_code == 202
    assert accepted.headers["deprecation"] == "@1796083200"  # RFC 9745: 2026-12-01
    assert accepted.headers["link"] == '</handlers/echo/jobs>; rel="successor-version"'
    done = client.get(accepted.headers["location"], params={"wait": 20}).json()
    assert done["output"] == {"old": True}
    # Where the segment names no handler, /jobs/{x} is the job's path, as documented.
    refused = client.post("/jobs/not-a-handler", json={})
    assert refused.status_code == 405
    assert refused.headers["allow"] == "DELETE, GET, HEAD"


def test_every_answer_carries_its_request_id(server: ServerProcess, client: httpx.Client) -> None:
    answers = {
        "200": client.post("/invoke/echo", json={}),
        "202": client.post("/invoke/echo", json={}, headers={"Prefer": "respond-async"}),
        "400": client.post("/invoke/echo", content=b"{not json"),
        "404 handler": client.post("/invoke/nope", json={}),
        "404 route": client.get("/no/such/route"),
        "405": client.put("/invoke/echo"),
        "500": client.post("/invoke/raises", json={}),
        "401": httpx.post(f"{server.url}/invoke/echo", json={}),
        "probe": client.get("/healthz"),
        "metrics": client.get("/metrics"),
    }
    ids = []
    for what, answer in answers.items():
        assert answer.headers.get("x-request-id"), what
        ids.append(answer.headers["x-request-id"])
    assert len(set(ids)) == len(ids)
    given = client.post("/invoke/echo", json={}, headers={"X-Request-Id": "trace-7f.1:a"})
    assert given.headers["x-request-id"] == "trace-7f.1:a"
    refused = client.post("/invoke/echo", json={}, headers={"X-Request-Id": "no spaces"})
    assert refused.headers["x-request-id"] not in ("no spaces", "")


def test_answers_that_depend_on_prefer_say_so(client: httpx.Client) -> None:
    for prefer in ("wait=5", "respond-async", "wait=oops"):
        answer = client.post("/invoke/echo", json={}, headers={"Prefer": prefer})
        assert "Prefer" in answer.headers.get_list("vary"), prefer
    assert "vary" not in client.post("/handlers/echo/jobs", json={}).headers
    assert "vary" not in client.get("/healthz").headers


def test_respond_async_with_a_wait_answers_within_the_wait_if_it_can(
    client: httpx.Client,
) -> None:
    quick = client.post("/invoke/echo", json={"q": 1}, headers={"Prefer": "respond-async, wait=10"})
    assert quick.status_code == 200 and quick.json() == {"q": 1}
    assert "preference-applied" not in quick.headers
    alone = client.post("/invoke/echo", json={}, headers={"Prefer": "respond-async"})
    assert alone.status_code == 202
    assert alone.headers["preference-applied"] == "respond-async"
    slow = client.post(
        "/invoke/sleepy", json={"s": 3}, headers={"Prefer": "respond-async, wait=0.2"}
    )
    assert slow.status_code == 202
    assert slow.headers["preference-applied"] == "respond-async"
    done = client.get(slow.headers["location"], params={"wait": 20}).json()
    assert done["status"] == "succeeded" and done["output"]["slept_s"] == 3


def test_one_access_line_per_request_naming_its_route_never_its_path(
    server: ServerProcess, client: httpx.Client
) -> None:
    sent = {
        "access-1": ("POST", f"/invoke/{MARK}", 404),
        "access-2": ("POST", "/invoke/echo", 200),
        "access-3": ("GET", f"/{MARK}/x", 404),
        "access-4": ("GET", f"/jobs/{MARK}?wait=0", 404),
    }
    for request_id, (method, path, _) in sent.items():
        client.request(method, path, json={"m": MARK}, headers={"X-Request-Id": request_id})

    def access(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [e for e in lines if e["logger"] == "thaw.access" and e.get("request_id") in sent]

    lines = wait_for_lines(server, lambda lines: len(access(lines)) >= len(sent))
    by_id = {entry["request_id"]: entry for entry in access(lines)}
    assert len(access(lines)) == len(sent), access(lines)
    routes = {"access-1": "/invoke/{handler}", "access-2": "/invoke/{handler}"}
    routes |= {"access-3": "(unmatched)", "access-4": "/jobs/{job_id}"}
    for request_id, (method, _, status) in sent.items():
        entry = by_id[request_id]
        assert entry["level"] == "info"
        assert entry["method"] == method and entry["status_code"] == status
        assert entry["route"] == routes[request_id]
        assert entry["duration_ms"] >= 0
    assert MARK not in server.log_path.read_text()


def test_every_line_about_a_request_and_its_job_names_the_request(
    server: ServerProcess, client: httpx.Client
) -> None:
    request_id = "job-trace-41"
    accepted = client.post(
        "/handlers/raises/jobs", json={"message": "x"}, headers={"X-Request-Id": request_id}
    )
    assert accepted.headers["x-request-id"] == request_id
    job_id = accepted.json()["id"]
    assert client.get(f"/jobs/{job_id}", params={"wait": 20}).json()["status"] == "failed"

    def about(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [e for e in lines if e.get("request_id") == request_id]

    lines = wait_for_lines(
        server, lambda lines: any(e["logger"] == "thaw.jobs" for e in about(lines))
    )
    loggers = {entry["logger"] for entry in about(lines)}
    # The access line, the handler's error, the job's end: all under the request's id.
    assert {"thaw.access", "thaw.dispatch", "thaw.jobs"} <= loggers, about(lines)
    for entry in lines:
        if job_id in entry["msg"] or entry.get("job_id") == job_id:
            assert entry.get("request_id") == request_id, entry


def samples(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = client.get("/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_time_requests_and_queue_waits_and_tell_client_errors_apart(
    client: httpx.Client,
) -> None:
    assert client.post("/invoke/echo", json={}).status_code == 200
    assert client.post("/invoke/echo", content=b"[1,").status_code == 400
    assert client.post("/invoke/raises", json={}).status_code == 500
    assert client.post(f"/invoke/{MARK}", json={}).status_code == 404
    found = samples(client)
    ok = (("method", "POST"), ("route", "/invoke/{handler}"), ("status", "200"))
    assert found[("thaw_http_request_duration_seconds_count", ok)] >= 1
    every = tuple(sorted((*ok, ("le", "+Inf"))))
    assert found[("thaw_http_request_duration_seconds_bucket", every)] >= 1
    assert found[("thaw_queue_wait_seconds_count", (("handler", "echo"),))] >= 1

    def invocations(handler: str, outcome: str) -> float:
        return found[("thaw_invocations_total", (("handler", handler), ("outcome", outcome)))]

    assert invocations("echo", "client_error") >= 1  # the invalid JSON
    assert invocations("raises", "error") >= 1 and invocations("raises", "client_error") == 0
    assert found[("process_cpu_seconds_total", ())] > 0
    assert found[("process_resident_memory_bytes", ())] > 0
    assert not any(MARK in value for _, labels in found for _, value in labels)
