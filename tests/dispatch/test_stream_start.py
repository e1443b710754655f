"""A stream stays a stream: with READY models, a caller that asks for the stream
is answered with it at once, never with a 202 job, whatever kind of handler it
is and whatever the work then waits for (a handler thread, a batch queue held
by a running batch, a decode slot), and whichever request, streaming or not,
created the handler's batch queue or decode steps.

Each case holds the handler busy with a gate, asks for the stream with a
deadline (`wait_s`) far shorter than the hold, and only then opens the gate:
an answer that waited for the work to begin would have become a job at the
deadline. The dispatcher in-process (tests/support.py `running_instance`),
over a real job store; no assertion bounds a duration.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime.dispatch.answers import STREAM, WAIT, Accepted, Completed, Streaming
from runtime.instance import Instance
from tests.handlers import batched, gated, stepped
from tests.support import make_bundle, running_instance, settings_for

pytestmark = pytest.mark.anyio

# Far shorter than any hold below: a stream that waited to begin would be a job.
SHORT_WAIT_S = 0.2


@pytest.fixture(autouse=True)
def gates() -> Iterator[None]:
    batched.GATE.clear()
    batched.BATCHES.clear()
    gated.GATE.clear()
    stepped.GATES.clear()
    yield
    batched.GATE.set()  # no handler thread outlives its test
    gated.GATE.set()
    for gate in stepped.GATES.values():
        gate.set()


@pytest.fixture
async def instance(tmp_path: Path) -> AsyncIterator[Instance]:
    make_bundle(tmp_path / "bundles", "ledger")
    settings = settings_for(
        tmp_path,
        handlers=(
            "tests.handlers.batched",
            "tests.handlers.gated",
            "tests.handlers.loadlog",
            "tests.handlers.stepped",
        ),
    )
    async with running_instance(settings) as inst:
        yield inst


async def settle(done: Callable[[], bool], what: str) -> None:
    """Yield to the loop until `done()`; a hang guard, not a time bound."""
    for _ in range(20_000):
        if done():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never: {what}")


def call(instance: Instance, handler: str, event: Any, rid: str, **kw: Any) -> asyncio.Task[Any]:
    kw.setdefault("wait_s", 30.0)
    return asyncio.ensure_future(instance.dispatcher.invoke(handler, event, request_id=rid, **kw))


async def streamed_output(answer: Any) -> Any:
    """The output a Streaming answer ends with (its stream's result)."""
    assert isinstance(answer, Streaming), f"a stream became {answer!r}"
    stream = answer.stream
    assert stream.outcome is not None
    await asyncio.wait_for(asyncio.shield(stream.outcome), 30)
    assert stream.error is None, stream.error
    return stream.result


async def output_of(answer: Any) -> Any:
    """The output of an occupier's answer, a stream's or a buffered one's."""
    if isinstance(answer, Completed):
        return answer.output
    return await streamed_output(answer)


async def test_a_plain_handler_streams_at_once_while_it_runs(instance: Instance) -> None:
    answer = await call(instance, "gated", {}, "s", policy=STREAM, wait_s=SHORT_WAIT_S)
    assert isinstance(answer, Streaming)
    assert not answer.stream.ended  # answered while the handler still waits in its thread
    gated.GATE.set()
    assert "thread" in await streamed_output(answer)


@pytest.mark.parametrize("first_streams", [False, True], ids=["queue-by-plain", "queue-by-stream"])
async def test_a_batched_handler_streams_at_once_whoever_made_its_queue(
    instance: Instance, first_streams: bool
) -> None:
    batcher = instance.dispatcher.batcher
    # The first request creates the handler's batch queue, and holds its batch.
    first = call(
        instance,
        "batch_gated",
        {"id": "h", "hold": True},
        "h",
        policy=STREAM if first_streams else WAIT,
    )
    await settle(lambda: batcher.running("batch_gated") == 1, "the first batch runs")
    # A stream whose batch waits for the run slot (never started beside the first).
    answer = await call(
        instance, "batch_gated", {"id": "s", "hold": True}, "s", policy=STREAM, wait_s=SHORT_WAIT_S
    )
    assert isinstance(answer, Streaming), answer
    assert not answer.stream.ended  # answered while its batch still holds
    batched.GATE.set()
    assert (await output_of(await first))["id"] == "h"
    assert (await streamed_output(answer))["id"] == "s"


@pytest.mark.parametrize("first_streams", [False, True], ids=["steps-by-plain", "steps-by-stream"])
async def test_a_step_level_handler_streams_at_once_while_it_waits_for_a_slot(
    instance: Instance, first_streams: bool
) -> None:
    decoder = instance.dispatcher.decoder
    # Three held sequences take every slot of Decode(max_sequences=3).
    holders = [
        call(
            instance,
            "stepped",
            {"name": f"h{i}", "n": 2, "hold_at": 1, "gate": "hold"},
            f"h{i}",
            policy=STREAM if first_streams else WAIT,
        )
        for i in range(3)
    ]
    await settle(lambda: any(len(step) == 1 for step in stepped.STEPS), "a held step began")
    await settle(lambda: decoder.waiting("stepped") == 2, "the other two wait for the step")
    answer = await call(
        instance, "stepped", {"name": "s", "n": 2}, "s", policy=STREAM, wait_s=SHORT_WAIT_S
    )
    assert isinstance(answer, Streaming)
    assert decoder.waiting("stepped") == 3  # it still waits for a slot
    stepped.GATES["hold"].set()
    assert await streamed_output(answer) == ["s:0", "s:1"]
    for i, holder in enumerate(holders):
        assert await output_of(await holder) == [f"h{i}:0", f"h{i}:1"]


async def test_a_handler_that_is_not_ready_still_becomes_a_job_past_the_deadline(
    instance: Instance,
) -> None:
    """The one case where a stream is a 202: its models must load first. (A batch
    held by its run slot is no such case: above.)"""
    # `batch_ledger` uses bundle `ledger`, not loaded yet: before any load the
    # estimate is the conservative default, which no 0.2 s deadline fits.
    answer = await call(
        instance, "batch_ledger", {"id": "x"}, "x", policy=STREAM, wait_s=SHORT_WAIT_S
    )
    assert isinstance(answer, Accepted)
