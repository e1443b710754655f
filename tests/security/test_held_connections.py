"""Held connections (job long-polls, job follows, invocation event streams) are
bounded per key and in total, and refused at once past either bound: 429
`quota-exceeded` for the key, 503 `overloaded` for the instance, with
Retry-After; a wait asked by `Prefer: wait` is bounded as `?wait=` is."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.types import Message

from runtime.errors import Overloaded, QuotaExceeded
from runtime.http.holds import Holds
from tests.inproc import until
from tests.security.inprocess import TENANT_A, TENANT_B, auth, serving, settings_under

pytestmark = pytest.mark.anyio


async def running_job(client: httpx.AsyncClient, key: str) -> str:
    """A job that runs until the test ends (a 30 s sleep, cancelled on the way out)."""
    accepted = await client.post("/handlers/sleepy/jobs", json={"s": 30}, headers=auth(key))
    assert accepted.status_code == 202, accepted.text
    job_id: str = accepted.json()["id"]
    return job_id


async def until_held(app: Starlette, count: int) -> None:
    holds: Holds = app.state.holds
    await until(lambda: holds.held >= count, f"{count} connections held")


async def test_waits_are_bounded_per_key_then_in_total(tmp_path: Path) -> None:
    settings = settings_under(tmp_path, max_held=3, max_held_per_key=2)
    async with serving(settings) as (app, client):
        job_a = await running_job(client, TENANT_A)
        job_b = await running_job(client, TENANT_B)
        polls = [
            asyncio.create_task(
                client.get(f"/jobs/{job_a}", params={"wait": 30}, headers=auth(TENANT_A))
            )
            for _ in range(2)
        ]
        await until_held(app, 2)
        # Tenant A holds its share: a third wait of A is refused at once, however it waits.
        over_key = [
            await client.get(f"/jobs/{job_a}", params={"wait": 30}, headers=auth(TENANT_A)),
            await client.get(
                f"/jobs/{job_a}", headers={**auth(TENANT_A), "Accept": "text/event-stream"}
            ),
        ]
        for refused in over_key:
            assert refused.status_code == 429, refused.text
            assert refused.json()["type"].endswith("/quota-exceeded")
            assert refused.headers["retry-after"] == "1"
        # A poll that does not wait holds nothing: A still reads its job.
        assert (await client.get(f"/jobs/{job_a}", headers=auth(TENANT_A))).status_code == 200
        # B has a share of its own, up to the instance's bound.
        polls.append(
            asyncio.create_task(
                client.get(f"/jobs/{job_b}", params={"wait": 30}, headers=auth(TENANT_B))
            )
        )
        await until_held(app, 3)
        over_total = await client.get(f"/jobs/{job_b}", params={"wait": 30}, headers=auth(TENANT_B))
        assert over_total.status_code == 503
        assert over_total.json()["type"].endswith("/overloaded")
        assert "THAW_MAX_HELD=3" in over_total.json()["detail"]
        assert (await client.get("/healthz")).status_code == 200
        # Ended waits give their holds back.
        for poll in polls:
            poll.cancel()
        await asyncio.gather(*polls, return_exceptions=True)
        holds: Holds = app.state.holds
        assert holds.held == 0 and holds.by_key == {}
        again = await client.get(f"/jobs/{job_a}", params={"wait": 0.01}, headers=auth(TENANT_A))
        assert again.status_code == 200 and again.json()["status"] == "running"


async def follower(
    app: Starlette, path: str, key: str, gone: asyncio.Event, method: str = "GET", body: bytes = b""
) -> list[Message]:
    """An event stream of `path` driven over ASGI itself (httpx's ASGI transport
    answers only once a response ends); the client goes away when `gone` is set."""
    sent: list[Message] = []
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"thaw"),
            (b"authorization", f"Bearer {key}".encode()),
            (b"accept", b"text/event-stream"),
            (b"content-type", b"application/json"),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("thaw", 80),
        "app": app,
    }
    requested = False

    async def receive() -> Message:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


async def test_a_follow_holds_until_its_stream_ends(tmp_path: Path) -> None:
    settings = settings_under(tmp_path, max_held=4, max_held_per_key=1, sse_heartbeat_s=0.05)
    async with serving(settings) as (app, client):
        job_a = await running_job(client, TENANT_A)
        gone = asyncio.Event()
        following = asyncio.create_task(follower(app, f"/jobs/{job_a}", TENANT_A, gone))
        await until_held(app, 1)
        refused = await client.get(f"/jobs/{job_a}", params={"wait": 5}, headers=auth(TENANT_A))
        assert refused.status_code == 429
        gone.set()
        sent = await following
        assert sent[0]["status"] == 200
        assert any(m.get("body", b"").startswith(b": keep-alive") for m in sent[1:])
        # The follower went away: its hold is given back, and the next wait is served.
        holds: Holds = app.state.holds
        assert holds.held == 0
        polled = await client.get(f"/jobs/{job_a}", params={"wait": 0.01}, headers=auth(TENANT_A))
        assert polled.status_code == 200


async def test_prefer_wait_is_bounded_like_the_wait_query(tmp_path: Path) -> None:
    """A wait of an hour, asked either way, ends at THAW_MAX_WAIT_S: a 202 with the
    job rather than the 30 s run's output; a long-poll answers the job still running."""
    settings = settings_under(tmp_path, max_wait_s=0.2)
    async with serving(settings) as (_, client):
        answer = await client.post(
            "/invoke/sleepy", json={"s": 30}, headers={**auth(TENANT_A), "Prefer": "wait=3600"}
        )
        assert answer.status_code == 202, answer.text
        job_id = answer.json()["id"]
        polled = await client.get(f"/jobs/{job_id}", params={"wait": 3600}, headers=auth(TENANT_A))
        assert polled.status_code == 200 and polled.json()["status"] in ("queued", "running")


async def test_an_invocation_stream_holds_its_connection(tmp_path: Path) -> None:
    settings = settings_under(
        tmp_path, handlers=("tests.handlers.ticks",), max_held=8, max_held_per_key=1
    )
    async with serving(settings) as (app, client):
        gone = asyncio.Event()
        slow = b'{"n": 1000, "gap_s": 0.02}'
        streaming = asyncio.create_task(
            follower(app, "/invoke/aticks", TENANT_A, gone, method="POST", body=slow)
        )
        await until_held(app, 1)
        refused = await client.post(
            "/invoke/aticks",
            json={"n": 2},
            headers={**auth(TENANT_A), "Accept": "text/event-stream"},
        )
        assert refused.status_code == 429 and refused.json()["type"].endswith("/quota-exceeded")
        # The same key's plain invocation holds nothing: it is served.
        plain = await client.post("/invoke/aticks", json={"n": 2}, headers=auth(TENANT_A))
        assert plain.status_code == 200 and plain.json()["ticks"] == 2
        gone.set()
        sent = await streaming
        assert sent[0]["status"] == 200
        holds: Holds = app.state.holds
        assert holds.held == 0


def test_without_keys_only_the_instance_bound_holds() -> None:
    """Auth off: no tenants to tell apart, so no per-key share; the total still bounds."""
    holds = Holds(total=3, per_key=1)
    for _ in range(3):
        holds.take(None)
    with pytest.raises(Overloaded):
        holds.take(None)
    with pytest.raises(Overloaded):
        holds.take("a-key")  # the instance is full for everyone
    holds.give(None)
    holds.take("a-key")
    with pytest.raises(QuotaExceeded):
        holds.take("a-key")
    assert holds.held == 3 and holds.by_key == {"a-key": 1}
