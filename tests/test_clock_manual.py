"""The instance's clock as components use it: timers, waits, deadlines made from epoch
times, and readiness conditions dated and timed.

Everything runs on a `ManualClock`, so what is asserted is order and outcome.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from runtime.aws.lambda_loop import MAX_MARGIN_S, deadline_on
from runtime.clock import SYSTEM, ManualClock
from runtime.context import Context
from runtime.telemetry.health import Health

pytestmark = pytest.mark.anyio


async def test_a_sleep_ends_only_once_the_clock_passes_it() -> None:
    clock = ManualClock()
    sleeper = asyncio.ensure_future(clock.sleep(10.0))
    await asyncio.sleep(0)
    clock.advance(9.0)
    await asyncio.sleep(0)
    assert not sleeper.done()
    clock.advance(1.0)
    await asyncio.wait_for(sleeper, 5)


async def test_a_sleep_of_nothing_needs_no_advance() -> None:
    clock = ManualClock()
    await asyncio.wait_for(clock.sleep(0.0), 5)
    await asyncio.wait_for(clock.sleep(-1.0), 5)
    assert clock.pending == 0


async def test_wait_until_returns_at_the_deadline_or_when_the_future_is_done() -> None:
    clock = ManualClock()
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(clock.wait_until(never, clock.monotonic() + 5.0))
    await asyncio.sleep(0)
    clock.advance(5.0)
    assert await asyncio.wait_for(waiting, 5) is False
    assert not never.cancelled(), "the future waited for is left alone"
    assert clock.pending == 0

    task = asyncio.ensure_future(asyncio.sleep(0, "done"))  # any future: a task's result type
    assert await asyncio.wait_for(clock.wait_until(task, clock.monotonic() + 60.0), 5) is True
    assert clock.pending == 0, "the deadline's timer is cancelled once the future is done"


async def test_wait_until_a_time_already_past_does_not_wait() -> None:
    clock = ManualClock()
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    assert await asyncio.wait_for(clock.wait_until(never, clock.monotonic()), 5) is False
    assert await asyncio.wait_for(SYSTEM.wait_until(never, SYSTEM.monotonic() - 1.0), 5) is False


def test_the_lambda_deadline_becomes_one_on_the_monotonic_clock() -> None:
    clock = ManualClock()
    deadline_ms = int((clock.wall() + 30.0) * 1000)
    deadline = deadline_on(clock, deadline_ms)
    assert deadline == pytest.approx(clock.monotonic() + 30.0 - MAX_MARGIN_S, abs=0.002)
    # Counted down on the monotonic clock from then on.
    clock.advance(10.0)
    assert deadline - clock.monotonic() == pytest.approx(20.0 - MAX_MARGIN_S, abs=0.002)
    assert deadline_on(clock, 0) == float("inf")


def test_a_health_condition_is_dated_on_the_wall_and_timed_on_the_monotonic_clock(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = ManualClock()
    health = Health(clock)
    began = clock.wall()
    with caplog.at_level(logging.INFO, logger="thaw.health"):
        health.report("job-store", "disk full")
        clock.advance(12.5)
        health.report("job-store", "still full")  # held: neither re-dated nor logged again
        shown = health.describe()
        health.clear("job-store")
    assert shown == [{"condition": "job-store", "detail": "disk full", "since": began}]
    assert health.ok
    assert [r.getMessage() for r in caplog.records] == [
        "unready: job-store: disk full",
        "ready again: job-store ended after 12.5 s",
    ]


def test_a_context_counts_its_deadline_down_on_its_clock() -> None:
    clock = ManualClock()
    ctx = Context(request_id="r", handler="h", deadline_at=clock.monotonic() + 5.0, clock=clock)
    assert ctx.remaining_s() == 5.0
    clock.advance(2.0)
    assert ctx.remaining_s() == 3.0
    clock.advance(10.0)
    assert ctx.remaining_s() == 0.0
    assert Context(request_id="r", handler="h", clock=clock).remaining_s() is None
