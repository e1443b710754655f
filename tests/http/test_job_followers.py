"""Followers of a streaming job (`GET /jobs/{id}` with `Accept: text/event-stream`)
against a real `thaw serve` process, over real HTTP:

- a follower attached before the job is cancelled ends as one that comes after:
  the same `event: error`, the job's `cancelled` error (not `drained`);
- `Last-Event-ID` never causes a 5xx, whatever its value: huge, not ASCII (raw
  bytes), negative, a fraction, garbage; a value that is not one of the ids the
  stream sends is 400, one past every item resumes at the end.

The handler is tests/handlers/ticks.py; a run holds at a tick while its hold file
exists, so what a follower has seen is decided by the test, never by timing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.sse import SSE, read_events
from tests.support import ServerProcess, until

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("followers")
    (root / "bundles").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("THAW_", "AWS_LAMBDA"))}
    env.update(
        {
            "THAW_HANDLERS": "tests.handlers.ticks,tests.handlers.stepped",
            "THAW_BUNDLE_SOURCE": str(root / "bundles"),
            "THAW_CACHE_DIR": str(root / "cache"),
            "THAW_STATE_DIR": str(root / "state"),
            "THAW_JOB_STORE": f"sqlite:///{root / 'jobs.sqlite3'}",
            "THAW_SSE_HEARTBEAT_S": "0.2",
            "PYTHONUNBUFFERED": "1",
        }
    )
    with ServerProcess(env) as started:
        yield started


def submit(client: httpx.Client, event: dict[str, Any], handler: str = "ticks") -> str:
    accepted = client.post(f"/handlers/{handler}/jobs", json=event)
    assert accepted.status_code == 202, accepted.text
    location: str = accepted.headers["location"]
    return location


def at_items(client: httpx.Client, location: str, count: int) -> None:
    until(
        lambda: client.get(location).json().get("progress", {}).get("items") == count,
        f"the job made {count} items",
    )


@pytest.mark.parametrize("handler", ["ticks", "stepped"], ids=["generator", "step-level"])
def test_a_live_follower_of_a_cancelled_job_gets_the_cancel_as_a_later_one(
    server: ServerProcess, tmp_path: Path, handler: str
) -> None:
    hold = tmp_path / "hold"
    if handler == "ticks":  # waits at tick 2 while the file exists
        hold.touch()
        event: dict[str, Any] = {"n": 100_000, "hold": str(hold), "hold_at": 2}
    else:  # its third step waits until the file exists
        event = {"name": "j", "n": 100_000, "hold_file": str(hold), "hold_at": 3}
    with server.client() as client, server.client() as canceller:
        location = submit(client, event, handler)
        at_items(client, location, 2)
        with client.stream("GET", location, headers=SSE) as followed:
            assert followed.status_code == 200
            events = read_events(followed.iter_lines())
            seen = []
            for event in events:
                if "data" in event:
                    seen.append(event)
                    if len(seen) == 2:
                        break
            # Attached and holding the first two items: now the job is cancelled.
            assert canceller.delete(location).json()["status"] == "cancelled"
            rest = [e for e in events if "comment" not in e]
        with client.stream("GET", location, headers=SSE) as later:
            after = [e for e in read_events(later.iter_lines()) if "comment" not in e]
    if handler == "ticks":
        hold.unlink()
    else:
        hold.touch()
    assert [e["id"] for e in seen] == ["0", "1"]
    assert [e.get("event") for e in rest] == ["error"]
    assert [e.get("event") for e in after] == ["error"]
    live_error, later_error = orjson.loads(rest[0]["data"]), orjson.loads(after[0]["data"])
    assert live_error == later_error
    assert live_error["type"] == "cancelled"


@pytest.fixture(scope="module")
def jobs(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """A finished streaming job, and one running (held at its first tick)."""
    hold = tmp_path_factory.mktemp("held") / "hold"
    hold.touch()
    with server.client() as client:
        finished = submit(client, {"n": 2})
        assert client.get(finished, params={"wait": 60}).json()["status"] == "succeeded"
        running = submit(client, {"n": 3, "hold": str(hold), "hold_at": 1})
        at_items(client, running, 1)
        yield [finished, running]
    hold.unlink()


def header_value(raw: bytes) -> bytes:
    """`raw` as a header value HTTP/1.1 can carry: no CR, LF, NUL or other controls
    (h11 refuses to send those), no surrounding whitespace."""
    return bytes(b for b in raw if (b >= 0x20 and b != 0x7F) or b == 0x09).strip(b" \t")


LAST_EVENT_IDS = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30).map(lambda n: str(n).encode()),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda f: repr(f).encode()),
    st.text(max_size=40).map(lambda t: t.encode("utf-8")),
    st.binary(max_size=64),
    st.integers(min_value=19, max_value=12_000).map(lambda n: b"9" * n),
).map(header_value)


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(last=LAST_EVENT_IDS)
@example(last=b"-1")
@example(last=b"1.5")
@example(last="\u00b2".encode())  # a digit to str.isdigit(), not to int()
@example(last="١٢".encode())  # Arabic-Indic digits
@example(last=b"\xff\xfe\x80")
@example(last=b"9" * 5000)  # past int()'s 4300-digit limit
@example(last=b"0")
@example(last=b"00000000000000000000000000001")
def test_last_event_id_never_causes_a_server_error(
    server: ServerProcess, jobs: list[str], last: bytes
) -> None:
    headers = {"accept": "text/event-stream", "last-event-id": last}
    with server.client() as client:
        for location in jobs:
            with client.stream("GET", location, headers=headers) as answer:
                assert answer.status_code < 500, (last, answer.status_code, answer.read())
                if answer.status_code == 400:
                    problem = orjson.loads(answer.read())
                    assert problem["type"].endswith("/bad-request")
                    assert "Last-Event-ID" in problem["detail"]
                else:
                    assert answer.status_code == 200
        # The invocation stream has no ids to resume after: the header is ignored.
        with client.stream("POST", "/invoke/ticks", json={"n": 1}, headers=headers) as invoked:
            assert invoked.status_code == 200
            assert [e.get("event") for e in read_events(invoked.iter_lines())][-1] == "result"


def test_a_valid_id_past_every_item_resumes_at_the_end(
    server: ServerProcess, jobs: list[str]
) -> None:
    with server.client() as client:
        for last in ("0", "7", "99999999999999999999999"):
            with client.stream("GET", jobs[0], headers={**SSE, "last-event-id": last}) as answer:
                events = [e for e in read_events(answer.iter_lines()) if "comment" not in e]
            assert [e.get("event") for e in events] == ["result"], last
            assert orjson.loads(events[0]["data"]) == {"text": "t0 t1 ", "ticks": 2}
