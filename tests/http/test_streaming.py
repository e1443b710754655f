"""Server-sent events from generator handlers, over real HTTP from a real `thaw serve`.

One server for the module (its handlers keep no state between tests but the
tick log, which each test reads for its own tag-free run in order).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.support import ServerProcess, make_bundle

SSE = {"accept": "text/event-stream"}


def read_events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """SSE as the spec parses it: fields until a blank line; comments kept as `comment`."""
    event: dict[str, Any] = {}
    for line in lines:
        if line == "":
            if event:
                yield event
            event = {}
        elif line.startswith(":"):
            yield {"comment": line[1:].strip()}
        else:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            event[name] = event[name] + "\n" + value if name in event else value
    if event:
        yield event


def collect(response: httpx.Response) -> list[dict[str, Any]]:
    return [e for e in read_events(response.iter_lines()) if "comment" not in e]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    import os

    root = tmp_path_factory.mktemp("streaming")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("THAW_", "AWS_LAMBDA"))}
    env.update(
        {
            "THAW_CACHE_DIR": str(root / "cache"),
            "THAW_STATE_DIR": str(root / "state"),
            "THAW_JOB_STORE": f"sqlite:///{root / 'jobs.sqlite3'}",
            "THAW_BUNDLE_SOURCE": str(root / "bundles"),
            "THAW_HANDLERS": "tests.handlers.ticks",
            "THAW_TEST_TICK_LOG": str(root / "ticks.log"),
            "THAW_SSE_HEARTBEAT_S": "0.05",
            "PYTHONUNBUFFERED": "1",
        }
    )
    make_bundle(root / "bundles", "tick-model", config={"sleep_s": 2.0})
    with ServerProcess(env) as started:
        yield started


def tick_log(server: ServerProcess) -> Path:
    return Path(server.env["THAW_TEST_TICK_LOG"])


def wait_for_end(log: Path, after: int) -> str:
    """The first `end` line written after byte `after` of the tick log."""
    for _ in range(2000):
        text = log.read_text()[after:] if log.exists() else ""
        ends = [line for line in text.splitlines() if line.startswith("end ")]
        if ends:
            return ends[0]
        time.sleep(0.01)
    raise AssertionError(f"no run ended; log: {text[-500:]}")


@pytest.mark.parametrize("handler", ["ticks", "aticks"])
def test_each_item_is_an_event_then_the_joined_result(server: ServerProcess, handler: str) -> None:
    with (
        server.client() as client,
        client.stream("POST", f"/invoke/{handler}", json={"n": 3}, headers=SSE) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        events = collect(response)
    assert [e.get("id") for e in events] == ["0", "1", "2", None]
    assert [orjson.loads(e["data"]) for e in events[:3]] == [{"text": f"t{i} "} for i in range(3)]
    assert events[3]["event"] == "result"
    assert orjson.loads(events[3]["data"]) == {"text": "t0 t1 t2 ", "ticks": 3}


@pytest.mark.parametrize("handler", ["ticks", "aticks"])
def test_a_caller_that_asks_for_no_stream_gets_the_items_joined(
    server: ServerProcess, handler: str
) -> None:
    with server.client() as client:
        response = client.post(f"/invoke/{handler}", json={"n": 4})
    assert response.status_code == 200
    assert response.json() == {"text": "t0 t1 t2 t3 ", "ticks": 4}


def test_gaps_carry_heartbeat_comments(server: ServerProcess) -> None:
    with (
        server.client() as client,
        client.stream("POST", "/invoke/ticks", json={"n": 2, "gap_s": 0.5}, headers=SSE) as resp,
    ):
        events = list(read_events(resp.iter_lines()))
    kinds = ["comment" if "comment" in e else e.get("event", "item") for e in events]
    # The gap between the two ticks is ten heartbeat periods long.
    first, second = kinds.index("item"), len(kinds) - 1 - kinds[::-1].index("item")
    assert "comment" in kinds[first:second]
    assert kinds[-1] == "result"


@pytest.mark.parametrize("handler", ["ticks", "aticks"])
def test_a_failure_midway_is_an_error_event(server: ServerProcess, handler: str) -> None:
    with (
        server.client() as client,
        client.stream("POST", f"/invoke/{handler}", json={"n": 5, "fail_at": 2}, headers=SSE) as r,
    ):
        assert r.status_code == 200
        events = collect(r)
    assert [orjson.loads(e["data"]) for e in events[:2]] == [{"text": "t0 "}, {"text": "t1 "}]
    assert events[2]["event"] == "error"
    problem = orjson.loads(events[2]["data"])
    assert problem["type"].endswith("/handler-error")
    assert problem["status"] == 500
    assert "tick 2 failed" in problem["detail"]
    assert len(events) == 3


def test_a_failure_before_any_item_is_a_plain_problem(server: ServerProcess) -> None:
    with server.client() as client:
        response = client.post("/invoke/ticks", json={"n": 5, "fail_at": 0}, headers=SSE)
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["type"].endswith("/handler-error")


@pytest.mark.parametrize("handler", ["ticks", "aticks"])
def test_a_client_that_disconnects_stops_the_generation(
    server: ServerProcess, handler: str
) -> None:
    log = tick_log(server)
    after = log.stat().st_size if log.exists() else 0
    event = {"n": 100_000, "gap_s": 0.02}
    with (
        server.client() as client,
        client.stream("POST", f"/invoke/{handler}", json=event, headers=SSE) as response,
    ):
        seen = 0
        for e in read_events(response.iter_lines()):
            seen += "data" in e
            if seen == 3:
                break
    # The connection is closed: the generator is closed (or cancelled) at its next item.
    end = wait_for_end(log, after)
    _, count, how = end.split()
    assert how == "closed"
    assert int(count) < event["n"]
    # And it stays stopped: the tick counter no longer advances.
    ticks_then = log.read_text()[after:].count("tick ")
    with server.client() as client:  # one more round trip through the server
        assert client.post("/invoke/ticks", json={"n": 0}).status_code == 200
    assert log.read_text()[after:].count("tick ") == ticks_then


def test_a_streaming_job_is_polled_with_its_output_so_far_then_followed(
    server: ServerProcess, tmp_path: Path
) -> None:
    hold = tmp_path / "hold"
    hold.touch()
    event = {"n": 5, "hold": str(hold), "hold_at": 2}
    with server.client() as client:
        accepted = client.post(
            "/invoke/ticks", json=event, headers={**SSE, "prefer": "respond-async"}
        )
        assert accepted.status_code == 202
        job_url = accepted.headers["location"]
        # Polled while it waits at tick 2: the output so far, and how many items.
        for _ in range(2000):
            job = client.get(job_url).json()
            if job.get("progress", {}).get("items") == 2:
                break
            time.sleep(0.01)
        assert job["status"] == "running"
        assert job["progress"] == {"items": 2, "partial_output": {"text": "t0 t1 ", "ticks": 2}}
        assert "output" not in job
        with client.stream("GET", job_url, headers=SSE) as followed:
            lines = followed.iter_lines()
            events = read_events(lines)
            replayed = [next(e for e in events if "data" in e) for _ in range(2)]
            hold.unlink()  # only now do ticks 2..4 exist
            rest = [e for e in events if "comment" not in e]
        assert [e["id"] for e in replayed] == ["0", "1"]
        assert [e.get("id") for e in rest] == ["2", "3", "4", None]
        assert rest[-1]["event"] == "result"
        assert orjson.loads(rest[-1]["data"]) == {"text": "t0 t1 t2 t3 t4 ", "ticks": 5}
        # Once done, the job object has the joined output, and following it gives its end.
        done = client.get(job_url, params={"wait": 10}).json()
        assert done["status"] == "succeeded"
        assert done["output"] == {"text": "t0 t1 t2 t3 t4 ", "ticks": 5}
        with client.stream("GET", job_url, headers=SSE) as again:
            ended = collect(again)
        assert [e.get("event") for e in ended] == ["result"]
        assert orjson.loads(ended[0]["data"]) == done["output"]


def test_following_an_unknown_job_is_404(server: ServerProcess) -> None:
    with server.client() as client:
        response = client.get("/jobs/nope", headers=SSE)
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/problem+json"


def test_cancelling_a_streaming_job_stops_its_generator(
    server: ServerProcess, tmp_path: Path
) -> None:
    log = tick_log(server)
    after = log.stat().st_size if log.exists() else 0
    hold = tmp_path / "hold"
    hold.touch()
    event = {"n": 100_000, "hold": str(hold), "hold_at": 2}
    with server.client() as client:
        accepted = client.post("/handlers/ticks/jobs", json=event)
        assert accepted.status_code == 202
        job_url = accepted.headers["location"]
        for _ in range(2000):
            if client.get(job_url).json().get("progress", {}).get("items") == 2:
                break
            time.sleep(0.01)
        assert client.delete(job_url).json()["status"] == "cancelled"
    hold.unlink()  # the handler goes on to its next item, and stops there
    _, count, how = wait_for_end(log, after).split()
    assert how == "closed"
    assert int(count) == 3


def test_a_load_past_the_deadline_is_a_job_and_a_ready_model_streams_at_once(
    server: ServerProcess,
) -> None:
    with server.client() as client:
        # Cold: the load (2 s) cannot fit a 0.3 s deadline: the usual 202 job.
        cold = client.post(
            "/invoke/model_ticks", json={"n": 2}, headers={**SSE, "prefer": "wait=0.3"}
        )
        assert cold.status_code == 202
        with client.stream("GET", cold.headers["location"], headers=SSE) as followed:
            events = collect(followed)
        assert orjson.loads(events[-1]["data"]) == {"text": "t0 t1 ", "ticks": 2}
        # READY: the stream starts at once, though its run (0.6 s) outlasts the deadline.
        event = {"n": 4, "gap_s": 0.2}
        with client.stream(
            "POST", "/invoke/model_ticks", json=event, headers={**SSE, "prefer": "wait=0.3"}
        ) as warm:
            assert warm.status_code == 200
            events = collect(warm)
        assert [e.get("id") for e in events] == ["0", "1", "2", "3", None]
