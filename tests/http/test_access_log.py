"""The access log, written after the answer (runtime/telemetry/logs.py `DeferredLines`):
every answered request leaves its line, complete and in the order the requests
ended, in a real `thaw serve` stopped by SIGTERM; a batch of lines written in one
piece is the same text the logger would write line by line; and lines wait off
the request's path for the flush window (or until enough are pending), then are
written in one piece, in order.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from runtime.clock import ManualClock
from runtime.telemetry.logs import (
    DEFERRED_LOGS,
    REQUEST_ID,
    DeferredLines,
    JSONFormatter,
    JSONLines,
)
from tests.support import SAFETY_S, ServerProcess

# The fields of an access line, in the order JSONFormatter writes them.
ACCESS_FIELDS = [
    "ts",
    "level",
    "logger",
    "msg",
    "request_id",
    "duration_ms",
    "method",
    "route",
    "status_code",
]
PATIENCE_S = 60.0
# When the lines below were answered (epoch seconds): a caller's wall clock.
AT = 1_800_000_000.5


def access_lines(text: str) -> list[dict[str, Any]]:
    entries = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    return [e for e in entries if e["logger"] == "thaw.access"]


def test_sigterm_after_n_requests_leaves_n_complete_lines_in_order(serve: Any) -> None:
    server: ServerProcess = serve(THAW_HANDLERS="handlers.echo")
    sent: list[tuple[str, str, str, int, str]] = []  # (id, method, path, status, route)
    with httpx.Client(base_url=server.url, timeout=PATIENCE_S) as client:
        for index in range(60):
            request_id = f"order-{index:03d}"
            method, path, status, route = [
                ("POST", "/invoke/echo", 200, "/invoke/{handler}"),
                ("POST", "/invoke/no-such-handler", 404, "/invoke/{handler}"),
                ("GET", "/healthz", 200, "/healthz"),
                ("GET", "/nowhere", 404, "(unmatched)"),
            ][index % 4]
            reply = client.request(method, path, json={}, headers={"X-Request-Id": request_id})
            assert reply.status_code == status, reply.text
            sent.append((request_id, method, path, status, route))
    # Then a burst from several connections at once, whose lines share loop turns.
    burst = [f"burst-{index:03d}" for index in range(40)]

    def one(request_id: str) -> int:
        with httpx.Client(base_url=server.url, timeout=PATIENCE_S) as client:
            headers = {"X-Request-Id": request_id}
            return client.post("/invoke/echo", json={"i": 1}, headers=headers).status_code

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, burst)) == [200] * len(burst)
    assert server.proc is not None
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(PATIENCE_S) == 0

    lines = access_lines(server.log_path.read_text())
    ours = [e for e in lines if e["request_id"].startswith(("order-", "burst-"))]
    # Every request once, none twice, none torn: each line parsed whole.
    assert sorted(e["request_id"] for e in ours) == sorted([s[0] for s in sent] + burst)
    # The sequential requests in the order they were answered.
    ordered = [e for e in ours if e["request_id"].startswith("order-")]
    assert [e["request_id"] for e in ordered] == [s[0] for s in sent]
    for entry, (_, method, _, status, route) in zip(ordered, sent, strict=True):
        assert list(entry) == ACCESS_FIELDS, entry
        assert entry["level"] == "info"
        assert (entry["method"], entry["route"], entry["status_code"]) == (method, route, status)
        assert entry["msg"] == f"{method} {route} {status} {entry['duration_ms']:.1f} ms"
        assert entry["duration_ms"] >= 0
    for entry in ours:
        assert entry["ts"].endswith("Z") and len(entry["ts"]) == len("2026-01-01T00:00:00.000Z")


@pytest.fixture
def root_handler() -> Iterator[list[logging.Handler]]:
    """The root logger's handlers, put back as they were after the test."""
    # Lines another test's app left pending (its loop ended within their window)
    # are written where they were going, not into this test's stream.
    DEFERRED_LOGS.flush()
    root = logging.getLogger()
    before, level = root.handlers[:], root.level
    root.setLevel(logging.INFO)
    installed: list[logging.Handler] = []
    try:
        yield installed
    finally:
        DEFERRED_LOGS.flush()
        root.handlers[:] = before
        root.setLevel(level)


def _install(stream: io.StringIO, *, filtered: bool) -> None:
    handler = JSONLines(stream)
    handler.setFormatter(JSONFormatter())
    if filtered:  # a filter on the way: lines go through the logger one record each
        handler.addFilter(lambda record: True)
    logging.getLogger().handlers[:] = [handler]


def _without_ts(text: str) -> list[dict[str, Any]]:
    return [{k: v for k, v in e.items() if k != "ts"} for e in access_lines(text)]


def test_a_batch_written_at_once_is_the_text_the_logger_writes(
    root_handler: list[logging.Handler],
) -> None:
    entries = [
        ("POST", "/invoke/{handler}", 200, 0.0003456, "req-a", AT),
        ("GET", "(unmatched)", 404, 1.5, "req-b", AT + 0.25),
        ("PURGE-THIS-METHOD-NAME-IS-LONG", "/jobs/{job_id}", 0, 0.0, "req-c", AT + 1),
    ]
    texts = []
    for filtered in (False, True):
        stream = io.StringIO()
        _install(stream, filtered=filtered)
        for entry in entries:
            DEFERRED_LOGS.add(*entry)  # outside a running loop: written at once
        texts.append(stream.getvalue())
    batched, one_by_one = texts
    assert batched.count("\n") == len(entries)
    assert _without_ts(batched) == _without_ts(one_by_one)
    for line in access_lines(batched) + access_lines(one_by_one):
        assert list(line) == ACCESS_FIELDS
    assert [e["method"] for e in access_lines(batched)] == ["POST", "GET", "PURGE-THIS-METHO"]
    assert access_lines(batched)[0]["msg"] == "POST /invoke/{handler} 200 0.3 ms"


@pytest.mark.anyio
async def test_lines_wait_for_the_window_then_are_written_together_in_order(
    root_handler: list[logging.Handler],
) -> None:
    stream = io.StringIO()
    _install(stream, filtered=False)
    log = DeferredLines(flush_after_s=SAFETY_S)  # a window no test run outlasts
    for index in range(3):
        log.add("GET", "/healthz", 200, 0.001, f"turn-{index}", AT)
    assert stream.getvalue() == ""  # not on the request's path
    await asyncio.sleep(0)
    assert stream.getvalue() == ""  # nor at the end of its loop turn: the window's end
    log.add("GET", "/healthz", 200, 0.001, "turn-3", AT)  # a later turn, the same window
    assert stream.getvalue() == ""
    log.flush()  # as the window's end, or the server's stop, does
    assert [e["request_id"] for e in access_lines(stream.getvalue())] == [
        "turn-0",
        "turn-1",
        "turn-2",
        "turn-3",
    ]
    log.flush()
    assert len(access_lines(stream.getvalue())) == 4  # written once


@pytest.mark.anyio
async def test_the_windows_end_writes_what_is_pending(root_handler: list[logging.Handler]) -> None:
    stream = io.StringIO()
    _install(stream, filtered=False)
    clock = ManualClock()
    log = DeferredLines(flush_after_s=0.05, clock=clock)
    log.add("GET", "/healthz", 200, 0.001, "timed", clock.wall())
    clock.advance(0.049)
    assert stream.getvalue() == ""
    clock.advance(0.001)  # the window's end, on the clock it was opened on
    assert [e["request_id"] for e in access_lines(stream.getvalue())] == ["timed"]
    assert access_lines(stream.getvalue())[0]["ts"].startswith("2027-01-15T08:00:00.")


@pytest.mark.anyio
async def test_a_full_window_is_written_at_once(root_handler: list[logging.Handler]) -> None:
    stream = io.StringIO()
    _install(stream, filtered=False)
    log = DeferredLines(flush_after_s=SAFETY_S, flush_lines=4)
    for index in range(3):
        log.add("GET", "/healthz", 200, 0.001, f"many-{index}", AT)
    assert stream.getvalue() == ""
    log.add("GET", "/healthz", 200, 0.001, "last", AT)
    written = [e["request_id"] for e in access_lines(stream.getvalue())]
    assert written == ["many-0", "many-1", "many-2", "last"]
    assert stream.getvalue().count("\n") == 4
    # The next line opens a window of its own.
    log.add("GET", "/healthz", 200, 0.001, "next", AT)
    assert len(access_lines(stream.getvalue())) == 4
    log.flush()
    assert access_lines(stream.getvalue())[-1]["request_id"] == "next"


def test_a_window_whose_loop_ended_does_not_hold_later_lines(
    root_handler: list[logging.Handler],
) -> None:
    stream = io.StringIO()
    _install(stream, filtered=False)
    log = DeferredLines(flush_after_s=SAFETY_S)

    async def one_line(request_id: str) -> None:
        log.add("GET", "/healthz", 200, 0.001, request_id, AT)

    asyncio.run(one_line("first-loop"))  # its loop closes before the window's end
    assert stream.getvalue() == ""
    asyncio.run(one_line("second-loop"))  # a window of its own, on the new loop
    log.add("GET", "/healthz", 200, 0.001, "no-loop", AT)  # outside any loop: written at once
    assert [e["request_id"] for e in access_lines(stream.getvalue())] == [
        "first-loop",
        "second-loop",
        "no-loop",
    ]


def test_a_later_info_line_is_the_line_its_logger_writes_in_order_with_access_lines(
    root_handler: list[logging.Handler],
) -> None:
    jobs_log = logging.getLogger("thaw.jobs")
    fields = {"job_id": "j-1", "handler": "echo", "status": "succeeded"}
    texts = []
    for filtered in (False, True):
        stream = io.StringIO()
        _install(stream, filtered=filtered)
        log = DeferredLines(flush_after_s=SAFETY_S)
        token = REQUEST_ID.set("req-job")
        try:
            log.add("POST", "/invoke/{handler}", 202, 0.001, "req-job", AT)
            log.info(jobs_log, "job j-1 succeeded", **fields)  # outside a loop: at once
        finally:
            REQUEST_ID.reset(token)
        texts.append(stream.getvalue())
    batched, one_by_one = texts

    def parsed(text: str) -> list[dict[str, Any]]:
        return [
            {k: v for k, v in json.loads(line).items() if k != "ts"} for line in text.splitlines()
        ]

    assert parsed(batched) == parsed(one_by_one)
    assert [e["logger"] for e in parsed(batched)] == ["thaw.access", "thaw.jobs"]
    # As the logger writes it at once, field for field.
    stream = io.StringIO()
    _install(stream, filtered=False)
    token = REQUEST_ID.set("req-job")
    try:
        jobs_log.info("job j-1 succeeded", extra=fields)
    finally:
        REQUEST_ID.reset(token)
    assert list(json.loads(stream.getvalue())) == list(json.loads(batched.splitlines()[1]))
    assert parsed(stream.getvalue()) == parsed(batched)[1:]


@pytest.mark.anyio
async def test_later_lines_of_a_logger_that_takes_no_info_are_not_written(
    root_handler: list[logging.Handler],
) -> None:
    stream = io.StringIO()
    _install(stream, filtered=False)
    jobs_log = logging.getLogger("thaw.jobs")
    jobs_log.setLevel(logging.WARNING)
    try:
        log = DeferredLines(flush_after_s=SAFETY_S)
        log.info(jobs_log, "job j-2 succeeded", job_id="j-2")
        log.add("GET", "/healthz", 200, 0.001, "still-written", AT)
        assert stream.getvalue() == ""  # both wait for one window
        log.flush()
    finally:
        jobs_log.setLevel(logging.NOTSET)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [e.get("request_id") for e in lines] == ["still-written"]


@pytest.mark.anyio
async def test_a_line_kept_outside_any_request_names_none_where_it_is_written(
    root_handler: list[logging.Handler],
) -> None:
    jobs_log = logging.getLogger("thaw.jobs")
    for filtered in (False, True):
        stream = io.StringIO()
        _install(stream, filtered=filtered)
        log = DeferredLines(flush_after_s=SAFETY_S, flush_lines=2)
        log.info(jobs_log, "job j-3 succeeded", job_id="j-3")  # no request: no id
        assert stream.getvalue() == ""
        token = REQUEST_ID.set("req-flushing")
        try:
            log.add("GET", "/healthz", 200, 0.001, "req-flushing", AT)  # the second: a flush
        finally:
            REQUEST_ID.reset(token)
        lines = [json.loads(line) for line in stream.getvalue().splitlines()]
        assert [(e["logger"], e.get("request_id")) for e in lines] == [
            ("thaw.jobs", None),
            ("thaw.access", "req-flushing"),
        ], filtered
