"""The run limit (THAW_RUN_TIMEOUT_S) counts a sync call's run, not its wait for a
handler thread.

One handler thread, a limit of 10 s on the manual clock, and three calls of
`held_call` (tests/handlers/held_calls.py) submitted together: `a` runs, `b`
and `c` wait behind it. Each runs less than the limit once a thread takes it,
though `c` waits longer than the limit before then: none times out and the
instance is not wedged. A call that then runs past the limit still fails, from
the moment its thread took it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from runtime.clock import ManualClock
from runtime.errors import HandlerTimeout
from runtime.instance import Instance
from runtime.registry import discover
from tests.handlers import held_calls
from tests.inproc import settings_for, until

pytestmark = pytest.mark.anyio
LIMIT_S = 10.0


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def instance(tmp_path: Path, clock: ManualClock) -> AsyncIterator[Instance]:
    held_calls.reset()
    settings = settings_for(
        tmp_path,
        handlers=("tests.handlers.held_calls",),
        handler_threads=1,
        run_timeout_s=LIMIT_S,
    )
    instance = Instance.create(settings, discover(settings.handlers), clock=clock)
    await instance.start()
    try:
        yield instance
    finally:
        held_calls.reset()
        await until(lambda: not instance.dispatcher.in_flight, "every call ended")
        await instance.stop()


def call(instance: Instance, run_id: str) -> asyncio.Future[Any]:
    return asyncio.ensure_future(
        instance.dispatcher.invoke("held_call", {"id": run_id}, wait_s=1000.0, request_id=run_id)
    )


async def test_a_call_waiting_for_a_thread_is_not_timed_by_its_wait(
    instance: Instance, clock: ManualClock
) -> None:
    calls = {run_id: call(instance, run_id) for run_id in "abc"}
    await until(lambda: held_calls.STARTED == ["a"], "a runs; b and c wait for the thread")

    in_flight = instance.dispatcher.in_flight
    clock.advance(9)  # t = 9: a has run 9 s
    held_calls.release("a")
    await until(lambda: held_calls.STARTED == ["a", "b"], "b takes the thread at t = 9")
    await until(lambda: calls["a"].done(), "a answered")
    # t = 10: b and c were submitted 10 s ago, but neither ran that long. The manual
    # clock fires the run-limit timer inside advance(): what it ends ends there.
    clock.advance(1)
    assert len(in_flight) == 2 and instance.health.wedged is None

    clock.advance(8)  # t = 18: b has run 9 s; c has waited 18 s
    held_calls.release("b")
    await until(lambda: held_calls.STARTED == ["a", "b", "c"], "c takes the thread at t = 18")
    await until(lambda: calls["b"].done(), "b answered")
    clock.advance(2)  # t = 20: c was watched again from t = 10, and runs since t = 18
    assert len(in_flight) == 1 and instance.health.wedged is None
    assert [(await calls[r]).output for r in "ab"] == [{"id": "a"}, {"id": "b"}]

    clock.advance(8.5)  # t = 28.5: c has run 10.5 s since its thread took it
    assert len(in_flight) == 0
    with pytest.raises(HandlerTimeout):
        await calls["c"]
    assert instance.health.wedged is not None  # its thread cannot be stopped
