"""The HTTP contract's edges, in-process (with API keys): the job-submit route and its
deprecated alias, X-Request-Id on every answer, `Vary: Prefer`, `respond-async,
wait=S`, the access log, the request id in every line about a request and its job,
and the request metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.inproc import LogLines, Served, captured_logs, serving, settings_for, until

pytestmark = pytest.mark.anyio

KEY = "contract-key-5be0c3"
AUTH = {"Authorization": f"Bearer {KEY}"}
MARK = "PATH-MARK-0f3a9d"
HANDLERS = ("handlers.echo", "tests.handlers.raises", "tests.handlers.sleepy")


@pytest.fixture(scope="module")
async def server(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[Served, LogLines]]:
    root = tmp_path_factory.mktemp("contract")
    (root / "bundles").mkdir()
    settings = settings_for(root, handlers=HANDLERS, api_keys=(KEY,))
    with captured_logs() as logs:
        async with serving(settings, headers=AUTH) as served:
            yield served, logs


@pytest.fixture
def client(server: tuple[Served, LogLines]) -> httpx.AsyncClient:
    return server[0].client


@pytest.fixture
def logs(server: tuple[Served, LogLines]) -> LogLines:
    return server[1]


async def wait_for_lines(
    logs: LogLines, found: Callable[[list[dict[str, Any]]], bool]
) -> list[dict[str, Any]]:
    """The log's lines, once `found` holds of them (they are written as work ends)."""
    await until(lambda: found(logs.entries()), "the log lines looked for")
    return logs.entries()


async def test_a_job_is_submitted_at_its_own_route_and_polled_at_its_location(
    client: httpx.AsyncClient,
) -> None:
    accepted = await client.post("/handlers/echo/jobs", json={"n": 1})
    assert accepted.status_code == 202
    job = accepted.json()
    assert accepted.headers["location"] == f"/jobs/{job['id']}"
    assert "deprecation" not in accepted.headers
    done = (await client.get(accepted.headers["location"], params={"wait": 20})).json()
    assert done["status"] == "succeeded" and done["output"] == {"n": 1}
    assert (
        (await client.post("/handlers/nope/jobs", json={}))
        .json()["type"]
        .endswith("/unknown-handler")
    )


async def test_the_old_submit_route_still_answers_marked_deprecated(
    client: httpx.AsyncClient,
) -> None:
    accepted = await client.post("/jobs/echo", json={"old": True})
    assert accepted.status_code == 202
    assert accepted.headers["deprecation"] == "@1796083200"  # RFC 9745: 2026-12-01
    assert accepted.headers["link"] == '</handlers/echo/jobs>; rel="successor-version"'
    done = (await client.get(accepted.headers["location"], params={"wait": 20})).json()
    assert done["output"] == {"old": True}
    # Where the segment names no handler, /jobs/{x} is the job's path, as documented.
    refused = await client.post("/jobs/not-a-handler", json={})
    assert refused.status_code == 405
    assert refused.headers["allow"] == "DELETE, GET, HEAD"


async def test_every_answer_carries_its_request_id(
    server: tuple[Served, LogLines], client: httpx.AsyncClient
) -> None:
    async with server[0].new_client() as anonymous:
        answers = {
            "200": await client.post("/invoke/echo", json={}),
            "202": await client.post("/invoke/echo", json={}, headers={"Prefer": "respond-async"}),
            "400": await client.post("/invoke/echo", content=b"{not json"),
            "404 handler": await client.post("/invoke/nope", json={}),
            "404 route": await client.get("/no/such/route"),
            "405": await client.put("/invoke/echo"),
            "500": await client.post("/invoke/raises", json={}),
            "401": await anonymous.post("/invoke/echo", json={}),
            "probe": await client.get("/healthz"),
            "metrics": await client.get("/metrics"),
        }
    ids = []
    for what, answer in answers.items():
        assert answer.headers.get("x-request-id"), what
        ids.append(answer.headers["x-request-id"])
    assert len(set(ids)) == len(ids)
    given = await client.post("/invoke/echo", json={}, headers={"X-Request-Id": "trace-7f.1:a"})
    assert given.headers["x-request-id"] == "trace-7f.1:a"
    refused = await client.post("/invoke/echo", json={}, headers={"X-Request-Id": "no spaces"})
    assert refused.headers["x-request-id"] not in ("no spaces", "")


async def test_answers_that_depend_on_prefer_say_so(client: httpx.AsyncClient) -> None:
    for prefer in ("wait=5", "respond-async", "wait=oops"):
        answer = await client.post("/invoke/echo", json={}, headers={"Prefer": prefer})
        assert "Prefer" in answer.headers.get_list("vary"), prefer
    assert "vary" not in (await client.post("/handlers/echo/jobs", json={})).headers
    assert "vary" not in (await client.get("/healthz")).headers


async def test_respond_async_with_a_wait_answers_within_the_wait_if_it_can(
    client: httpx.AsyncClient,
) -> None:
    quick = await client.post(
        "/invoke/echo", json={"q": 1}, headers={"Prefer": "respond-async, wait=10"}
    )
    assert quick.status_code == 200 and quick.json() == {"q": 1}
    assert "preference-applied" not in quick.headers
    alone = await client.post("/invoke/echo", json={}, headers={"Prefer": "respond-async"})
    assert alone.status_code == 202
    assert alone.headers["preference-applied"] == "respond-async"
    slow = await client.post(
        "/invoke/sleepy", json={"s": 3}, headers={"Prefer": "respond-async, wait=0.2"}
    )
    assert slow.status_code == 202
    assert slow.headers["preference-applied"] == "respond-async"
    done = (await client.get(slow.headers["location"], params={"wait": 20})).json()
    assert done["status"] == "succeeded" and done["output"]["slept_s"] == 3


async def test_one_access_line_per_request_naming_its_route_never_its_path(
    logs: LogLines, client: httpx.AsyncClient
) -> None:
    sent = {
        "access-1": ("POST", f"/invoke/{MARK}", 404),
        "access-2": ("POST", "/invoke/echo", 200),
        "access-3": ("GET", f"/{MARK}/x", 404),
        "access-4": ("GET", f"/jobs/{MARK}?wait=0", 404),
    }
    for request_id, (method, path, _) in sent.items():
        await client.request(method, path, json={"m": MARK}, headers={"X-Request-Id": request_id})

    def access(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [e for e in lines if e["logger"] == "thaw.access" and e.get("request_id") in sent]

    lines = await wait_for_lines(logs, lambda lines: len(access(lines)) >= len(sent))
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
    assert MARK not in logs.text


async def test_every_line_about_a_request_and_its_job_names_the_request(
    logs: LogLines, client: httpx.AsyncClient
) -> None:
    request_id = "job-trace-41"
    accepted = await client.post(
        "/handlers/raises/jobs", json={"message": "x"}, headers={"X-Request-Id": request_id}
    )
    assert accepted.headers["x-request-id"] == request_id
    job_id = accepted.json()["id"]
    assert (await client.get(f"/jobs/{job_id}", params={"wait": 20})).json()["status"] == "failed"

    def about(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [e for e in lines if e.get("request_id") == request_id]

    # The access line waits for its flush window (runtime/telemetry/logs.py): both.
    lines = await wait_for_lines(
        logs,
        lambda lines: {"thaw.access", "thaw.jobs"} <= {e["logger"] for e in about(lines)},
    )
    loggers = {entry["logger"] for entry in about(lines)}
    # The access line, the handler's error, the job's end: all under the request's id.
    assert {"thaw.access", "thaw.dispatch", "thaw.jobs"} <= loggers, about(lines)
    for entry in lines:
        if job_id in entry["msg"] or entry.get("job_id") == job_id:
            assert entry.get("request_id") == request_id, entry


async def samples(
    client: httpx.AsyncClient,
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = (await client.get("/metrics")).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_metrics_time_requests_and_queue_waits_and_tell_client_errors_apart(
    client: httpx.AsyncClient,
) -> None:
    assert (await client.post("/invoke/echo", json={})).status_code == 200
    assert (await client.post("/invoke/echo", content=b"[1,")).status_code == 400
    assert (await client.post("/invoke/raises", json={})).status_code == 500
    assert (await client.post(f"/invoke/{MARK}", json={})).status_code == 404
    found = await samples(client)
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
