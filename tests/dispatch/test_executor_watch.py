"""The executor runs user code and times it: THAW_RUN_TIMEOUT_S is its watch.

A real `Executor` with one handler thread and its run-limit watch on the
manual clock (limit 10 s), running real handlers: `held_call`
(tests/handlers/held_calls.py, sync: each call waits in its thread until the
test releases it) and `ahang` (tests/handlers/stuck.py, async: waits on the
loop for its release file). What each call runs for is a `Run`, the
executor's `Watched`, that records when it is told it overran; the call's end
forgets it, as `Work.settle` does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from runtime.clock import ManualClock
from runtime.context import Context
from runtime.dispatch.executor import Executor, Outcome
from runtime.registry import discover
from tests.handlers import held_calls
from tests.inproc import until

pytestmark = pytest.mark.anyio
LIMIT_S = 10.0


class Run:
    """What one call runs for: told when it overran (on the clock, when)."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.overran: list[float] = []
        self.ended: Outcome | None = None

    def overrun(self) -> None:
        self.overran.append(self.clock.monotonic())


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def executor(clock: ManualClock) -> Iterator[Executor]:
    held_calls.reset()
    executor = Executor(1, run_limit_s=LIMIT_S, clock=clock)
    yield executor
    held_calls.reset()  # a call left held ends, and its thread with it
    executor.shutdown()


def ended(executor: Executor, run: Run, done: Outcome) -> None:
    """A call's end, on the loop: its run is forgotten (`Work.settle`)."""
    run.ended = done
    executor.forget(run)


def start(
    executor: Executor, handler: str, event: dict[str, Any], run: Run
) -> asyncio.Future[Any] | None:
    module = "tests.handlers.held_calls" if handler == "held_call" else "tests.handlers.stuck"
    spec = discover([module]).handler(handler)
    ctx = Context(request_id=str(id(run)), handler=handler, clock=run.clock)
    call = partial(spec.fn, event, ctx)
    return executor.run(spec, call, partial(ended, executor, run), watched=[run])


async def test_a_sync_call_that_waited_for_a_thread_is_timed_from_when_one_took_it(
    executor: Executor, clock: ManualClock
) -> None:
    t0 = clock.monotonic()
    a, b = Run(clock), Run(clock)
    start(executor, "held_call", {"id": "a"}, a)
    start(executor, "held_call", {"id": "b"}, b)  # waits for the one thread, behind a
    assert len(executor.overruns) == 2, "both watched from their hand-over"
    await until(lambda: held_calls.STARTED == ["a"], "a runs; b waits for the thread")

    clock.advance(9)  # t0 + 9: a has run 9 s
    held_calls.release("a")
    await until(lambda: held_calls.STARTED == ["a", "b"], "b takes the thread at t0 + 9")
    await until(lambda: a.ended is not None, "a ended, and was forgotten")
    clock.advance(1)  # t0 + 10: b was handed over 10 s ago, but has run 1 s
    assert a.overran == [] and b.overran == []
    assert len(executor.overruns) == 1, "b is watched again, from t0 + 9"

    clock.advance(8.5)  # t0 + 18.5: b has run 9.5 s
    assert b.overran == []
    clock.advance(0.5)  # t0 + 19: b has run 10 s since its thread took it
    assert b.overran == [t0 + 19]
    assert len(executor.overruns) == 0, "told once, and no longer watched"
    clock.advance(3 * LIMIT_S)
    assert b.overran == [t0 + 19] and a.overran == []

    held_calls.release("b")  # a thread cannot be stopped: it runs to its end
    await until(lambda: b.ended is not None, "b ended")
    done = b.ended
    assert done is not None and done.result() == {"id": "b"}


async def test_a_call_watched_again_from_when_its_thread_took_it_is_told_when_that_is_due(
    executor: Executor, clock: ManualClock, tmp_path: Path
) -> None:
    """Even where a run handed over since is due later: `b` is taken at t0 + 4 and
    `x` handed over at t0 + 5, so at t0 + 10 `b` is watched again out of start
    order; it is told at t0 + 14, not when `x` is due (t0 + 15)."""
    t0 = clock.monotonic()
    a, b, x = Run(clock), Run(clock), Run(clock)
    start(executor, "held_call", {"id": "a"}, a)
    start(executor, "held_call", {"id": "b"}, b)
    await until(lambda: held_calls.STARTED == ["a"], "a runs; b waits for the thread")
    clock.advance(4)
    held_calls.release("a")
    await until(lambda: held_calls.STARTED == ["a", "b"], "b takes the thread at t0 + 4")
    await until(lambda: a.ended is not None, "a ended, and was forgotten")
    clock.advance(1)  # t0 + 5
    x_call = start(executor, "ahang", {"release": str(tmp_path / "never")}, x)
    assert x_call is not None
    clock.advance(5)  # t0 + 10: b was handed over 10 s ago, and has run 6 s
    assert b.overran == [] and len(executor.overruns) == 2
    clock.advance(4)  # t0 + 14
    assert b.overran == [t0 + 14] and x.overran == []
    clock.advance(1)  # t0 + 15
    assert x.overran == [t0 + 15] and a.overran == []

    x_call.cancel()
    held_calls.release("b")
    await until(lambda: b.ended is not None and x.ended is not None, "b and x ended")


async def test_an_async_call_is_told_once_it_overran_and_forgotten_when_it_ends(
    executor: Executor, clock: ManualClock, tmp_path: Path
) -> None:
    t0 = clock.monotonic()
    quick, slow = Run(clock), Run(clock)
    released = tmp_path / "released"
    quick_call = start(executor, "ahang", {"release": str(released)}, quick)
    slow_call = start(executor, "ahang", {"release": str(tmp_path / "never")}, slow)
    assert quick_call is not None and slow_call is not None
    assert len(executor.overruns) == 2

    released.touch()
    await until(lambda: quick.ended is not None, "the quick call ended, and was forgotten")
    assert len(executor.overruns) == 1
    clock.advance(LIMIT_S)
    assert quick.overran == [] and slow.overran == [t0 + LIMIT_S]
    assert len(executor.overruns) == 0 and not slow_call.done(), "told, not stopped"
    clock.advance(3 * LIMIT_S)
    assert slow.overran == [t0 + LIMIT_S], "told once"

    slow_call.cancel()  # what its work does with it (`Work.settle`: cancelled at its await)
    await until(lambda: slow.ended is not None, "the slow call ended, cancelled")
    assert slow_call.cancelled()
