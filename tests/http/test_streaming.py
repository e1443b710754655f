"""Server-sent events from generator handlers, over real HTTP: the app on uvicorn in
this process (tests/inproc.py `listening`), since httpx's ASGI transport answers
only once a response is whole, and these tests read streams as they arrive and
close connections midway.

One server for the module (its handlers keep no state between tests but the
tick log, which each test reads for its own tag-free run in order).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.inproc import Listening, listening, settings_for, until
from tests.sse import SSE, acollect, aread_events, collect, read_events
from tests.support import make_bundle

pytestmark = pytest.mark.anyio

# `SSE`, `collect` and `read_events` (the sync readers) are also what
# tests/pretrained/test_generate_streaming.py reads its streams with.
__all__ = ["SSE", "collect", "read_events"]


@pytest.fixture(scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Listening]:
    root = tmp_path_factory.mktemp("streaming")
    settings = settings_for(root, handlers=("tests.handlers.ticks",), sse_heartbeat_s=0.05)
    make_bundle(root / "bundles", "tick-model", config={"sleep_s": 2.0})
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("THAW_TEST_TICK_LOG", str(root / "ticks.log"))  # the fixture handler's
        async with listening(settings) as started:
            yield started


def tick_log(server: Listening) -> Path:
    return Path(server.instance.settings.state_dir).parent / "ticks.log"


async def wait_for_end(log: Path, after: int) -> str:
    """The first `end` line written after byte `after` of the tick log."""

    def ended() -> str | None:
        text = log.read_text()[after:] if log.exists() else ""
        ends = [line for line in text.splitlines() if line.startswith("end ")]
        return ends[0] if ends else None

    line: str = await until(ended, "a run ended")
    return line


@pytest.mark.parametrize("handler", ["ticks", "aticks"])
async def test_each_item_is_an_event_then_the_joined_result(
    server: Listening, handler: str
) -> None:
    async with (
        server.client() as client,
        client.stream("POST", f"/invoke/{handler}", json={"n": 3}, headers=SSE) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        events = await acollect(response)
    assert [e.get("id") for e in events] == ["0", "1", "2", None]
    assert [orjson.loads(e["data"]) for e in events[:3]] == [{"text": f"t{i} "} for i in range(3)]
    assert events[3]["event"] == "result"
    assert orjson.loads(events[3]["data"]) == {"text": "t0 t1 t2 ", "ticks": 3}


@pytest.mark.parametrize("handler", ["ticks", "aticks"])
async def test_a_caller_that_asks_for_no_stream_gets_the_items_joined(
    server: Listening, handler: str
) -> None:
    async with server.client() as client:
        response = await client.post(f"/invoke/{handler}", json={"n": 4})
    assert response.status_code == 200
    assert response.json() == {"text": "t0 t1 t2 t3 ", "ticks": 4}


async def test_gaps_carry_heartbeat_comments(server: Listening) -> None:
    event = {"n": 2, "gap_s": 0.5}
    async with (
        server.client() as client,
        client.stream("POST", "/invoke/ticks", json=event, headers=SSE) as resp,
    ):
        events = [e async for e in aread_events(resp.aiter_lines())]
    kinds = ["comment" if "comment" in e else e.get("event", "item") for e in events]
    # The gap between the two ticks is ten heartbeat periods long.
    first, second = kinds.index("item"), len(kinds) - 1 - kinds[::-1].index("item")
    assert "comment" in kinds[first:second]
    assert kinds[-1] == "result"


@pytest.mark.parametrize("handler", ["ticks", "aticks"])
async def test_a_failure_midway_is_an_error_event(server: Listening, handler: str) -> None:
    event = {"n": 5, "fail_at": 2}
    async with (
        server.client() as client,
        client.stream("POST", f"/invoke/{handler}", json=event, headers=SSE) as r,
    ):
        assert r.status_code == 200
        events = await acollect(r)
    assert [orjson.loads(e["data"]) for e in events[:2]] == [{"text": "t0 "}, {"text": "t1 "}]
    assert events[2]["event"] == "error"
    problem = orjson.loads(events[2]["data"])
    assert problem["type"].endswith("/handler-error")
    assert problem["status"] == 500
    assert "tick 2 failed" in problem["detail"]
    assert len(events) == 3


async def test_a_failure_before_any_item_is_a_plain_problem(server: Listening) -> None:
    async with server.client() as client:
        response = await client.post("/invoke/ticks", json={"n": 5, "fail_at": 0}, headers=SSE)
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["type"].endswith("/handler-error")


@pytest.mark.parametrize("handler", ["ticks", "aticks"])
async def test_a_client_that_disconnects_stops_the_generation(
    server: Listening, handler: str
) -> None:
    log = tick_log(server)
    after = log.stat().st_size if log.exists() else 0
    event = {"n": 100_000, "gap_s": 0.02}
    async with (
        server.client() as client,
        client.stream("POST", f"/invoke/{handler}", json=event, headers=SSE) as response,
    ):
        seen = 0
        async for e in aread_events(response.aiter_lines()):
            seen += "data" in e
            if seen == 3:
                break
    # The connection is closed: the generator is closed (or cancelled) at its next item.
    end = await wait_for_end(log, after)
    _, count, how = end.split()
    assert how == "closed"
    assert int(count) < event["n"]
    # And it stays stopped: the tick counter no longer advances.
    ticks_then = log.read_text()[after:].count("tick ")
    async with server.client() as client:  # one more round trip through the server
        assert (await client.post("/invoke/ticks", json={"n": 0})).status_code == 200
    assert log.read_text()[after:].count("tick ") == ticks_then


async def test_a_streaming_job_is_polled_with_its_output_so_far_then_followed(
    server: Listening, tmp_path: Path
) -> None:
    hold = tmp_path / "hold"
    hold.touch()
    event = {"n": 5, "hold": str(hold), "hold_at": 2}
    async with server.client() as client:
        accepted = await client.post(
            "/invoke/ticks", json=event, headers={**SSE, "prefer": "respond-async"}
        )
        assert accepted.status_code == 202
        job_url = accepted.headers["location"]

        # Polled while it waits at tick 2: the output so far, and how many items.
        async def at_tick_2() -> dict[str, Any] | None:
            job: dict[str, Any] = (await client.get(job_url)).json()
            return job if job.get("progress", {}).get("items") == 2 else None

        job = await until(at_tick_2, "the job reached tick 2")
        assert job["status"] == "running"
        assert job["progress"] == {"items": 2, "partial_output": {"text": "t0 t1 ", "ticks": 2}}
        assert "output" not in job
        async with client.stream("GET", job_url, headers=SSE) as followed:
            events = aread_events(followed.aiter_lines())
            replayed = []
            async for e in events:
                if "data" in e:
                    replayed.append(e)
                    if len(replayed) == 2:
                        break
            hold.unlink()  # only now do ticks 2..4 exist
            rest = [e async for e in events if "comment" not in e]
        assert [e["id"] for e in replayed] == ["0", "1"]
        assert [e.get("id") for e in rest] == ["2", "3", "4", None]
        assert rest[-1]["event"] == "result"
        assert orjson.loads(rest[-1]["data"]) == {"text": "t0 t1 t2 t3 t4 ", "ticks": 5}
        # Once done, the job object has the joined output, and following it gives its end.
        done = (await client.get(job_url, params={"wait": 10})).json()
        assert done["status"] == "succeeded"
        assert done["output"] == {"text": "t0 t1 t2 t3 t4 ", "ticks": 5}
        async with client.stream("GET", job_url, headers=SSE) as again:
            ended = await acollect(again)
        assert [e.get("event") for e in ended] == ["result"]
        assert orjson.loads(ended[0]["data"]) == done["output"]


async def test_following_an_unknown_job_is_404(server: Listening) -> None:
    async with server.client() as client:
        response = await client.get("/jobs/nope", headers=SSE)
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/problem+json"


async def test_cancelling_a_streaming_job_stops_its_generator(
    server: Listening, tmp_path: Path
) -> None:
    log = tick_log(server)
    after = log.stat().st_size if log.exists() else 0
    hold = tmp_path / "hold"
    hold.touch()
    event = {"n": 100_000, "hold": str(hold), "hold_at": 2}
    async with server.client() as client:
        accepted = await client.post("/handlers/ticks/jobs", json=event)
        assert accepted.status_code == 202
        job_url = accepted.headers["location"]

        async def at_tick_2() -> bool:
            job = (await client.get(job_url)).json()
            return bool(job.get("progress", {}).get("items") == 2)

        await until(at_tick_2, "the job reached tick 2")
        assert (await client.delete(job_url)).json()["status"] == "cancelled"
    hold.unlink()  # the handler goes on to its next item, and stops there
    _, count, how = (await wait_for_end(log, after)).split()
    assert how == "closed"
    assert int(count) == 3


async def test_a_load_past_the_deadline_is_a_job_and_a_ready_model_streams_at_once(
    server: Listening,
) -> None:
    async with server.client() as client:
        # Cold: the load (2 s) cannot fit a 0.3 s deadline: the usual 202 job.
        cold = await client.post(
            "/invoke/model_ticks", json={"n": 2}, headers={**SSE, "prefer": "wait=0.3"}
        )
        assert cold.status_code == 202
        async with client.stream("GET", cold.headers["location"], headers=SSE) as followed:
            events = await acollect(followed)
        assert orjson.loads(events[-1]["data"]) == {"text": "t0 t1 ", "ticks": 2}
        # READY: the stream starts at once, though its run (0.6 s) outlasts the deadline.
        event = {"n": 4, "gap_s": 0.2}
        async with client.stream(
            "POST", "/invoke/model_ticks", json=event, headers={**SSE, "prefer": "wait=0.3"}
        ) as warm:
            assert warm.status_code == 200
            events = await acollect(warm)
        assert [e.get("id") for e in events] == ["0", "1", "2", "3", None]
