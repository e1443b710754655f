"""One timer for every waiting request: each is woken at its own deadline, not before.

On a loop whose clock moves only when it would sleep (tests/dispatch/virtual_clock.py):
each wake-up is asserted at the exact loop time it is due, with no wall-clock bound.
"""

from __future__ import annotations

import asyncio

import pytest

from runtime.dispatch.deadlines import Deadlines
from tests.dispatch.virtual_clock import run


def at(seconds: float) -> object:
    return pytest.approx(seconds, abs=1e-9)


async def _woken_after(deadlines: Deadlines, in_s: float) -> float:
    """Wait with nothing settling the future; loop seconds from now until woken."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    await deadlines.wait(loop.create_future(), started + in_s)
    return loop.time() - started


def test_a_waiter_nobody_settles_is_woken_at_its_deadline() -> None:
    async def scenario() -> None:
        deadlines = Deadlines()
        assert await _woken_after(deadlines, 0.1) == at(0.1)
        assert len(deadlines) == 0

    run(scenario())


def test_a_settled_waiter_returns_when_settled_and_leaves() -> None:
    async def scenario() -> None:
        deadlines = Deadlines()
        loop = asyncio.get_running_loop()
        settled: asyncio.Future[None] = loop.create_future()
        loop.call_later(0.02, settled.set_result, None)
        started = loop.time()
        await deadlines.wait(settled, started + 5.0)
        assert loop.time() - started == at(0.02)  # when it was settled, not at 5 s
        assert len(deadlines) == 0

    run(scenario())


def test_an_earlier_deadline_arriving_later_is_not_missed() -> None:
    # The timer is armed for the first waiter (2 s); the second (0.1 s) must re-arm it.
    async def scenario() -> None:
        deadlines = Deadlines()
        slow = asyncio.ensure_future(_woken_after(deadlines, 2.0))
        await asyncio.sleep(0)
        assert await _woken_after(deadlines, 0.1) == at(0.1)
        assert not slow.done()
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        assert len(deadlines) == 0, "a cancelled waiter leaves no entry behind"

    run(scenario())


def test_each_waiter_wakes_at_its_own_deadline_after_early_leavers() -> None:
    # Early leavers do not move the timer: it fires for a waiter already gone,
    # and must re-arm itself for those still waiting.
    async def scenario() -> None:
        deadlines = Deadlines()
        loop = asyncio.get_running_loop()
        early: asyncio.Future[None] = loop.create_future()
        gone = asyncio.ensure_future(deadlines.wait(early, loop.time() + 0.05))
        waits = [asyncio.ensure_future(_woken_after(deadlines, s)) for s in (0.15, 0.25)]
        await asyncio.sleep(0)
        early.set_result(None)
        await gone
        # A timer that is not re-armed would leave these waiting forever.
        first, second = await asyncio.wait_for(asyncio.gather(*waits), 2.0)
        assert (first, second) == (at(0.15), at(0.25))

    run(scenario())


def test_a_deadline_already_past_wakes_without_waiting() -> None:
    async def scenario() -> None:
        deadlines = Deadlines()
        loop = asyncio.get_running_loop()
        started = loop.time()
        await deadlines.wait(loop.create_future(), started - 1.0)
        assert loop.time() == started

    run(scenario())
