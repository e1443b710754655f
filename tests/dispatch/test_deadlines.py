"""One timer for every waiting request: each is woken at its own deadline, not before."""

from __future__ import annotations

import asyncio
import time

import pytest

from runtime.dispatch.deadlines import Deadlines

pytestmark = pytest.mark.anyio

# Loop timers fire up to a clock tick late, and this machine is shared.
LATE_S = 0.05


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _woken_after(deadlines: Deadlines, in_s: float) -> float:
    """Wait with nothing settling the future; seconds from now until woken."""
    started = time.monotonic()
    await deadlines.wait(asyncio.get_running_loop().create_future(), started + in_s)
    return time.monotonic() - started


async def test_a_waiter_nobody_settles_is_woken_at_its_deadline() -> None:
    deadlines = Deadlines()
    waited = await _woken_after(deadlines, 0.1)
    assert 0.1 <= waited < 0.1 + LATE_S
    assert len(deadlines) == 0


async def test_a_settled_waiter_returns_at_once_and_leaves() -> None:
    deadlines = Deadlines()
    loop = asyncio.get_running_loop()
    settled: asyncio.Future[None] = loop.create_future()
    loop.call_later(0.02, settled.set_result, None)
    started = time.monotonic()
    await deadlines.wait(settled, started + 5.0)
    assert time.monotonic() - started < 1.0
    assert len(deadlines) == 0


async def test_an_earlier_deadline_arriving_later_is_not_missed() -> None:
    # The timer is armed for the first waiter (2 s); the second (0.1 s) must re-arm it.
    deadlines = Deadlines()
    slow = asyncio.ensure_future(_woken_after(deadlines, 2.0))
    await asyncio.sleep(0)
    fast = await asyncio.wait_for(_woken_after(deadlines, 0.1), 1.0)
    assert 0.1 <= fast < 0.1 + LATE_S
    assert not slow.done()
    slow.cancel()
    with pytest.raises(asyncio.CancelledError):
        await slow
    assert len(deadlines) == 0, "a cancelled waiter leaves no entry behind"


async def test_each_waiter_wakes_at_its_own_deadline_after_early_leavers() -> None:
    # Early leavers do not move the timer: it fires for a waiter already gone,
    # and must re-arm itself for those still waiting.
    deadlines = Deadlines()
    loop = asyncio.get_running_loop()
    early: asyncio.Future[None] = loop.create_future()
    now = time.monotonic()
    gone = asyncio.ensure_future(deadlines.wait(early, now + 0.05))
    waits = [asyncio.ensure_future(_woken_after(deadlines, s)) for s in (0.15, 0.25)]
    await asyncio.sleep(0)
    early.set_result(None)
    await gone
    # A timer that is not re-armed would leave these waiting forever.
    first, second = await asyncio.wait_for(asyncio.gather(*waits), 2.0)
    assert 0.15 <= first < 0.15 + LATE_S
    assert 0.25 <= second < 0.25 + LATE_S


async def test_a_deadline_already_past_wakes_in_the_next_turn() -> None:
    deadlines = Deadlines()
    started = time.monotonic()
    await deadlines.wait(asyncio.get_running_loop().create_future(), started - 1.0)
    assert time.monotonic() - started < LATE_S
