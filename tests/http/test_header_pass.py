"""`Edge` reads the headers once and the warm path takes the few it needs from that
pass (X-Request-Id, Content-Length, Accept, Prefer): each must read as Starlette's
own `request.headers` would, whatever their number, order or case of value."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.inproc import serving, settings_for

pytestmark = pytest.mark.anyio


async def test_every_prefer_line_counts_not_only_the_first(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, handlers=("handlers.echo",))
    async with serving(settings) as served:
        headers = [("prefer", "handling=lenient"), ("prefer", "respond-async")]
        answer = await served.client.post("/invoke/echo", json={"a": 1}, headers=headers)
        assert answer.status_code == 202, answer.text
        assert answer.headers["preference-applied"] == "respond-async"
        # No Prefer at all: answered at once.
        plain = await served.client.post("/invoke/echo", json={"a": 1})
        assert plain.status_code == 200 and plain.json() == {"a": 1}


async def test_the_declared_length_is_refused_before_the_body_is_read(tmp_path: Path) -> None:
    settings = settings_for(
        tmp_path, handlers=("handlers.echo",), max_body_bytes=16, max_buffered_bytes=1024
    )
    async with serving(settings) as served:
        big = b'{"text": "' + b"x" * 64 + b'"}'
        answer = await served.client.post(
            "/invoke/echo", content=big, headers={"content-type": "application/json"}
        )
        assert answer.status_code == 413, answer.text
        assert answer.json()["limit_bytes"] == 16
        assert str(len(big)) in answer.json()["detail"]


async def test_accept_asks_for_events_in_any_case_and_any_position(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, handlers=("tests.handlers.ticks",))
    async with serving(settings) as served:
        headers = [("accept", "application/json, TEXT/Event-Stream"), ("accept", "text/plain")]
        answer = await served.client.post("/invoke/ticks", json={"n": 2}, headers=headers)
        assert answer.status_code == 200, answer.text
        assert answer.headers["content-type"].startswith("text/event-stream")
        assert "event: result" in answer.text
        # Only a later Accept line asks for events: Starlette reads the first.
        headers = [("accept", "application/json"), ("accept", "text/event-stream")]
        joined = await served.client.post("/invoke/ticks", json={"n": 2}, headers=headers)
        assert joined.headers["content-type"].startswith("application/json")
        assert joined.json()["ticks"] == 2


async def test_the_first_valid_request_id_is_the_correlation_id(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, handlers=("handlers.echo",))
    async with serving(settings) as served:
        headers = [("x-request-id", "first-id"), ("x-request-id", "second-id")]
        answer = await served.client.post("/invoke/echo", json={}, headers=headers)
        assert answer.status_code == 200
        assert answer.headers["x-request-id"] == "first-id"
        assert answer.headers["x-thaw-request-id"] not in ("first-id", "second-id")
