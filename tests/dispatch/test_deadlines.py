"""One timer for every waiting request: each is woken at its own deadline, not before.

On a `ManualClock` (runtime/clock.py), which moves only when the test advances
it: each wake-up is asserted at the exact clock time it is due, with no
wall-clock bound.
"""

from __future__ import annotations

import asyncio

import pytest

from runtime.clock import ManualClock
from runtime.dispatch.deadlines import Deadlines

pytestmark = pytest.mark.anyio


async def turns(n: int = 3) -> None:
    """Let the loop run what is ready (a woken waiter resumes in the next turn)."""
    for _ in range(n):
        await asyncio.sleep(0)


def nobody_settles() -> asyncio.Future[None]:
    return asyncio.get_running_loop().create_future()


async def test_a_waiter_nobody_settles_is_woken_at_its_deadline() -> None:
    clock = ManualClock()
    deadlines = Deadlines(clock)
    waiter = asyncio.ensure_future(deadlines.wait(nobody_settles(), clock.monotonic() + 0.1))
    await turns()
    clock.advance(0.099)
    await turns()
    assert not waiter.done(), "woken before its deadline"
    clock.advance(0.001)
    await turns()
    assert waiter.done()
    assert len(deadlines) == 0


async def test_a_settled_waiter_returns_when_settled_and_leaves() -> None:
    clock = ManualClock()
    deadlines = Deadlines(clock)
    settled = nobody_settles()
    waiter = asyncio.ensure_future(deadlines.wait(settled, clock.monotonic() + 5.0))
    await turns()
    clock.advance(0.02)
    settled.set_result(None)
    await turns()
    assert waiter.done(), "when it was settled, not at 5 s"
    assert len(deadlines) == 0


async def test_an_earlier_deadline_arriving_later_is_not_missed() -> None:
    # The timer is armed for the first waiter (2 s); the second (0.1 s) must re-arm it.
    clock = ManualClock()
    deadlines = Deadlines(clock)
    slow = asyncio.ensure_future(deadlines.wait(nobody_settles(), clock.monotonic() + 2.0))
    await turns()
    fast = asyncio.ensure_future(deadlines.wait(nobody_settles(), clock.monotonic() + 0.1))
    await turns()
    clock.advance(0.1)
    await turns()
    assert fast.done() and not slow.done()
    slow.cancel()
    with pytest.raises(asyncio.CancelledError):
        await slow
    assert len(deadlines) == 0, "a cancelled waiter leaves no entry behind"


async def test_each_waiter_wakes_at_its_own_deadline_after_early_leavers() -> None:
    # Early leavers do not move the timer: it fires for a waiter already gone,
    # and must re-arm itself for those still waiting.
    clock = ManualClock()
    deadlines = Deadlines(clock)
    now = clock.monotonic()
    early = nobody_settles()
    gone = asyncio.ensure_future(deadlines.wait(early, now + 0.05))
    first = asyncio.ensure_future(deadlines.wait(nobody_settles(), now + 0.15))
    second = asyncio.ensure_future(deadlines.wait(nobody_settles(), now + 0.25))
    await turns()
    early.set_result(None)
    await gone
    woken: list[tuple[float, bool, bool]] = []
    for step in (0.05, 0.1, 0.1):
        clock.advance(step)
        await turns()
        woken.append((round(clock.monotonic() - now, 9), first.done(), second.done()))
    # A timer that is not re-armed would leave these waiting forever.
    assert woken == [(0.05, False, False), (0.15, True, False), (0.25, True, True)]


async def test_a_deadline_already_past_wakes_without_waiting() -> None:
    clock = ManualClock()
    deadlines = Deadlines(clock)
    waiter = asyncio.ensure_future(deadlines.wait(nobody_settles(), clock.monotonic() - 1.0))
    await turns()
    clock.advance(0.0)
    await turns()
    assert waiter.done(), "woken with no time passing"


async def test_the_timer_is_armed_on_the_clock_it_was_given() -> None:
    # Deadlines are on the instance's clock: its timer is that clock's, never the loop's.
    clock = ManualClock()
    deadlines = Deadlines(clock)
    waiter = asyncio.ensure_future(deadlines.wait(nobody_settles(), clock.monotonic() + 30.0))
    await turns()
    assert clock.pending == 1 and not waiter.done()
    clock.advance(30.0)
    await turns()
    assert waiter.done() and clock.pending == 0
