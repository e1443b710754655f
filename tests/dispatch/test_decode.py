"""The decode scheduler (runtime/dispatch/decode.py) with a model-less step handler
(tests/handlers/stepped.py), over the HTTP contract in-process: sequences share
steps up to the declared maximum, later ones join between steps, each caller gets
its own items, a fault or a refusal is one caller's, and a drain lets running
sequences finish within its grace and ends the rest with the drain error."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.handlers import stepped
from tests.inproc import listening, serving, settings_for, until
from tests.sse import SSE, aread_events, read_events

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def fresh_logs() -> Iterator[None]:
    stepped.STEPS.clear()
    stepped.RELEASED.clear()
    stepped.EVENTS.clear()
    stepped.GATES.clear()
    yield
    for gate in stepped.GATES.values():  # never leave a handler thread waiting
        gate.set()


def settings(tmp_path: Path, **overrides: Any) -> Any:
    return settings_for(tmp_path, handlers=("tests.handlers.stepped",), **overrides)


async def test_sequences_share_steps_and_later_ones_join_between_them(tmp_path: Path) -> None:
    lengths = {"a": 3, "b": 4, "c": 4, "d": 2, "e": 2}
    async with serving(settings(tmp_path)) as served:
        decoder = served.instance.dispatcher.decoder

        def call(name: str) -> Any:
            event: dict[str, Any] = {"name": name, "n": lengths[name]}
            if name == "a":  # holds its second step until the others queued behind it
                event.update(hold_at=2, gate="a")
            return asyncio.ensure_future(served.client.post("/invoke/stepped", json=event))

        first = call("a")
        await until(lambda: len(stepped.STEPS) == 2, "a's second step began")
        others = [call(name) for name in "bcde"]
        # While a's step holds, b and c take the two free slots (of max_sequences=3)
        # and are prefilled (their first steps, on a thread of their own); d and e wait.
        await until(
            lambda: decoder.running("stepped") == 3 and decoder.waiting("stepped") == 2,
            "b and c prefilled, d and e waiting",
        )
        stepped.GATES["a"].set()
        responses = [await first, *[await other for other in others]]
    for (name, n), response in zip(lengths.items(), responses, strict=True):
        assert response.status_code == 200, response.text
        assert response.json() == [f"{name}:{i}" for i in range(n)]
    steps = stepped.STEPS
    # Each new sequence's first step is its own (right after its prefill, in arrival
    # order), taken while a's step ran; then they join a's next step.
    assert steps[:5] == [["a"], ["a"], ["b"], ["c"], ["a", "b", "c"]]
    # a ended there: d took its slot (between steps, not after the others ended),
    # then e took the next one freed.
    assert steps.index(["d"]) < steps.index(["e"])
    assert max(len(step) for step in steps) == 3  # Decode(max_sequences=3)
    assert sorted(stepped.RELEASED) == sorted(lengths)  # each freed, once
    for name, n in lengths.items():
        assert sum(name in step for step in steps) == n


async def _held_sequence_meets_a_prefill(served: Any, handler: str) -> tuple[Any, Any]:
    """`a` (4 steps) holds its second step until `b`'s prefill, held by its own gate,
    has begun; then a's step ends with b's prefill still in flight."""
    first = asyncio.ensure_future(
        served.client.post(f"/invoke/{handler}", json={"name": "a", "n": 4, "hold_at": 2})
    )
    await until(lambda: stepped.EVENTS.count("step a") == 2, "a's second step began")
    second = asyncio.ensure_future(
        served.client.post(f"/invoke/{handler}", json={"name": "b", "n": 2, "prefill_gate": "b"})
    )
    await until(lambda: "prefill b" in stepped.EVENTS, "b's prefill began")
    stepped.GATES[""].set()  # a's second step ends
    await until(lambda: stepped.EVENTS.count("stepped a") >= 2, "a's second step ended")
    return first, second


async def test_a_step_waits_for_a_prefill_in_flight(tmp_path: Path) -> None:
    """With a pause, the held sequences' next step begins only once the new prompt
    is in: the two never contend for the interpreter."""
    async with serving(settings(tmp_path)) as served:
        first, second = await _held_sequence_meets_a_prefill(served, "stepped_paused")
        stepped.GATES["b"].set()
        responses = [await first, await second]
    assert [r.status_code for r in responses] == [200, 200]
    events = stepped.EVENTS
    third_step = [i for i, e in enumerate(events) if e.startswith("step ")][2]
    assert events.index("prefilled b") < third_step, events


async def test_without_a_pause_the_steps_go_on_beside_a_prefill(tmp_path: Path) -> None:
    async with serving(settings(tmp_path)) as served:
        first, second = await _held_sequence_meets_a_prefill(served, "stepped_beside")
        # a's last two steps run while b's prompt is still held.
        await until(lambda: stepped.EVENTS.count("stepped a") == 4, "a's steps ran")
        assert "prefilled b" not in stepped.EVENTS
        stepped.GATES["b"].set()
        responses = [await first, await second]
    assert [r.json() for r in responses] == [[f"a:{i}" for i in range(4)], ["b:0", "b:1"]]


async def test_a_prefill_that_hangs_pauses_the_steps_only_a_step_long(tmp_path: Path) -> None:
    """The default pause is the last step's own time: a prompt that never ends
    holds nobody's tokens for longer than one more step."""
    async with serving(settings(tmp_path)) as served:
        first, second = await _held_sequence_meets_a_prefill(served, "stepped")
        response = await first  # all four of a's steps, with b's prefill still held
        assert "prefilled b" not in stepped.EVENTS
        stepped.GATES["b"].set()
        await second
    assert response.json() == [f"a:{i}" for i in range(4)]


async def test_a_sequence_that_raises_fails_only_its_own_caller(tmp_path: Path) -> None:
    async with serving(settings(tmp_path)) as served:
        bad, good = await asyncio.gather(
            served.client.post("/invoke/stepped", json={"name": "bad", "n": 4, "fail_at": 2}),
            served.client.post("/invoke/stepped", json={"name": "good", "n": 4}),
        )
    assert bad.status_code == 500, bad.text
    assert bad.json()["type"].endswith("/handler-error")
    assert "bad failed at step 2" in bad.json()["detail"]
    assert good.status_code == 200 and good.json() == [f"good:{i}" for i in range(4)]
    assert sorted(stepped.RELEASED) == ["bad", "good"]  # its sequence freed all the same


@pytest.mark.parametrize(
    ("fault", "where"),
    [
        ({"crash": True}, "crashed in its prefill"),
        ({"fail_at": 1}, "failed at step 1"),  # its first step, on the prefill thread
        ({"fail_at": 3}, "failed at step 3"),  # a step it shares with the other
    ],
)
async def test_a_fault_anywhere_in_a_sequence_fails_only_its_caller(
    tmp_path: Path, fault: dict[str, Any], where: str
) -> None:
    async with serving(settings(tmp_path)) as served:
        decoder = served.instance.dispatcher.decoder
        good = asyncio.ensure_future(
            served.client.post(
                "/invoke/stepped", json={"name": "good", "n": 6, "hold_at": 2, "gate": "g"}
            )
        )
        await until(lambda: len(stepped.STEPS) == 2, "good's second step began")
        bad = asyncio.ensure_future(
            served.client.post("/invoke/stepped", json={"name": "bad", "n": 5, **fault})
        )
        # While good's step holds, bad is prefilled (or fails there) beside it.
        await until(lambda: bad.done() or decoder.running("stepped") == 2, "bad prefilled")
        stepped.GATES["g"].set()
        bad_response, good_response = await bad, await good
    assert bad_response.status_code == 500, bad_response.text
    assert bad_response.json()["type"].endswith("/handler-error")
    assert where in bad_response.json()["detail"]
    assert good_response.status_code == 200, good_response.text
    assert good_response.json() == [f"good:{i}" for i in range(6)]
    if "fail_at" in fault and fault["fail_at"] > 1:
        assert ["good", "bad"] in stepped.STEPS  # it failed in a step the two shared
    # Every sequence that began is freed once, the failed one too.
    assert sorted(stepped.RELEASED) == (["good"] if "crash" in fault else ["bad", "good"])


async def test_a_refused_sequence_is_a_400_and_the_others_run(tmp_path: Path) -> None:
    async with serving(settings(tmp_path)) as served:
        refused, fine = await asyncio.gather(
            served.client.post("/invoke/stepped", json={"name": "no", "n": 2, "refuse": True}),
            served.client.post("/invoke/stepped", json={"name": "yes", "n": 2}),
        )
        streamed = await served.client.post(
            "/invoke/stepped",
            json={"name": "no", "n": 2, "refuse": True},
            headers={"Accept": "text/event-stream"},
        )
    assert refused.status_code == 400 and refused.json()["field"] == "refuse"
    assert streamed.status_code == 400  # refused before its first item: no 200 stream
    assert fine.status_code == 200 and fine.json() == ["yes:0", "yes:1"]
    assert stepped.RELEASED == ["yes"]  # a refused sequence never started


async def test_each_streaming_caller_gets_its_own_items(tmp_path: Path) -> None:
    async with serving(settings(tmp_path)) as served:
        responses = await asyncio.gather(
            *(
                served.client.post(
                    "/invoke/stepped",
                    json={"name": name, "n": 3},
                    headers={"Accept": "text/event-stream"},
                )
                for name in ("x", "y")
            )
        )
    for name, response in zip(("x", "y"), responses, strict=True):
        events = [e for e in read_events(response.text.splitlines()) if "comment" not in e]
        items = [e["data"] for e in events if "id" in e]
        assert items == [f'"{name}:{i}"' for i in range(3)], response.text
        assert events[-1]["event"] == "result"


async def test_drain_lets_a_running_sequence_finish_within_its_grace(tmp_path: Path) -> None:
    async with serving(settings(tmp_path, drain_grace_s=60.0)) as served:
        dispatcher = served.instance.dispatcher
        call = asyncio.ensure_future(
            served.client.post(
                "/invoke/stepped", json={"name": "held", "n": 3, "hold_at": 2, "gate": "g"}
            )
        )
        await until(lambda: len(stepped.STEPS) >= 2, "the second step began")
        drain = asyncio.ensure_future(dispatcher.drain(60.0))
        await until(lambda: dispatcher.draining, "the drain began", every_s=0)
        refused = await served.client.post("/invoke/stepped", json={"name": "late", "n": 1})
        assert refused.status_code == 503  # no new sequence is admitted
        stepped.GATES["g"].set()
        response = await call
        await drain
    assert response.status_code == 200 and response.json() == ["held:0", "held:1", "held:2"]


async def test_drain_ends_a_sequence_past_its_grace_with_the_drain_error(
    tmp_path: Path,
) -> None:
    async with serving(settings(tmp_path)) as served:
        dispatcher = served.instance.dispatcher
        decoder = dispatcher.decoder
        call = asyncio.ensure_future(
            served.client.post(
                "/invoke/stepped", json={"name": "held", "n": 3, "hold_at": 2, "gate": "g"}
            )
        )
        await until(lambda: len(stepped.STEPS) >= 2, "the second step began")
        assert decoder.running("stepped") == 1
        drain = asyncio.ensure_future(dispatcher.drain(0.0))
        response = await call
        assert response.status_code == 503, response.text
        assert response.json()["type"].endswith("/drained")
        stepped.GATES["g"].set()  # the step it was in ends; the next one drops it
        await drain
        await until(lambda: stepped.RELEASED == ["held"], "the cut-off sequence released")
        await until(lambda: decoder.running("stepped") == 0, "no sequence held")
    assert sum("held" in step for step in stepped.STEPS) == 2  # no step after the cut


async def test_a_job_shows_its_sequence_so_far_and_follows_it(tmp_path: Path) -> None:
    async with listening(settings(tmp_path)) as served, served.client() as client:
        event = {"name": "j", "n": 3, "hold_at": 3, "gate": "j"}
        accepted = await client.post(
            "/invoke/stepped", json=event, headers={"Prefer": "respond-async"}
        )
        assert accepted.status_code == 202, accepted.text
        location = accepted.headers["location"]

        async def two_items() -> Any:
            job = (await client.get(location)).json()
            return job if (job.get("progress") or {}).get("items") == 2 else None

        job = await until(two_items, "two items delivered")  # its third step holds
        assert job["status"] == "running"
        assert job["progress"]["partial_output"] == ["j:0", "j:1"]
        async with client.stream("GET", location, headers=SSE) as followed:
            events = aread_events(followed.aiter_lines())
            replayed = [e async for e in _items(events, 2)]
            stepped.GATES["j"].set()
            rest = [e async for e in events if "comment" not in e]
        done = (await client.get(f"{location}?wait=30")).json()
    assert [e["data"] for e in replayed] == ['"j:0"', '"j:1"']
    assert [e["data"] for e in rest if "id" in e] == ['"j:2"']
    assert rest[-1]["event"] == "result"
    assert done["status"] == "succeeded" and done["output"] == ["j:0", "j:1", "j:2"]


async def _items(events: Any, count: int) -> Any:
    async for event in events:
        if "id" in event:
            yield event
            count -= 1
            if not count:
                return
