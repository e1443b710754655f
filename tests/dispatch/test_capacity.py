"""Capacity is a promise: a handler declared one-at-a-time never runs twice at once.

The reproduction of issue 53, in-process on the manual clock: one instance on
SQLite, `one_at_a_time` (tests/handlers/one_at_a_time.py: max_concurrent=1,
each run held until the test ends it). Jobs queue behind the running call, and
sync callers whose deadline comes while they wait get their 202 job; neither a
deadline nor a start-by time ever starts a call beside the running one, and
every invocation runs exactly once, one after another.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from runtime.clock import ManualClock
from runtime.dispatch.answers import JOB_NOW
from runtime.instance import Instance
from runtime.jobs.job import JobStatus
from runtime.registry import discover
from tests.handlers.one_at_a_time import RUNS
from tests.inproc import settings_for

pytestmark = pytest.mark.anyio
HANDLER = "one_at_a_time"


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def instance(tmp_path: Path, clock: ManualClock) -> AsyncIterator[Instance]:
    RUNS.reset()
    settings = settings_for(tmp_path, handlers=("tests.handlers.one_at_a_time",))
    instance = Instance.create(settings, discover(settings.handlers), clock=clock)
    await instance.start()
    try:
        yield instance
    finally:
        RUNS.finish_all()
        await until(lambda: not instance.dispatcher.in_flight, "every run ended")
        await instance.stop()


async def until(done: Callable[[], bool], what: str) -> None:
    """Yield to the loop (and the store's threads) until `done()`; a hang guard only."""
    for _ in range(20_000):
        if done():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never: {what}")


async def job(instance: Instance, run_id: Any) -> Any:
    answer = await instance.invoke(HANDLER, {"id": run_id}, policy=JOB_NOW, request_id=run_id)
    return answer.job


async def run_through(instance: Instance, expected: int) -> None:
    """End the running call, one at a time, until `expected` calls have run; at
    most one ever runs."""
    while True:
        await until(lambda: bool(RUNS.open) or RUNS.running == 0, "a run, or none left")
        if not RUNS.open:
            break
        assert RUNS.running == 1 and len(RUNS.open) == 1
        ran = len(RUNS.started)
        [run_id] = RUNS.open
        RUNS.finish(run_id)
        if ran < expected:
            await until(lambda ran=ran: len(RUNS.started) > ran, f"run {ran + 1} started")
        else:
            await until(lambda: RUNS.running == 0, "the last run ended")
    assert len(RUNS.started) == expected and RUNS.peak == 1


async def test_sync_callers_at_their_deadline_get_jobs_and_start_nothing_beside_the_running_call(
    instance: Instance, clock: ManualClock
) -> None:
    jobs = [await job(instance, f"job-{i}") for i in range(6)]
    await until(lambda: RUNS.started == ["job-0"], "the first job runs")
    calls = [
        asyncio.ensure_future(
            instance.invoke(HANDLER, {"id": f"sync-{i}"}, wait_s=1.0, request_id=f"sync-{i}")
        )
        for i in range(2)
    ]
    pending = instance.dispatcher.pending
    await until(lambda: pending[HANDLER] == 8, "both callers admitted")
    clock.advance(1.0)
    answers = [await call for call in calls]
    assert [type(a).__name__ for a in answers] == ["Accepted", "Accepted"]
    assert RUNS.started == ["job-0"] and RUNS.peak == 1, "nothing started beside job-0"

    await run_through(instance, 8)
    assert sorted(RUNS.started) == sorted([f"job-{i}" for i in range(6)] + ["sync-0", "sync-1"])
    for accepted in [*jobs, *(a.job for a in answers)]:
        done = await instance.job(accepted.id, key_id=None, wait_s=10.0)
        assert done.status is JobStatus.SUCCEEDED, done


async def test_queued_jobs_past_their_wait_start_one_after_another(
    instance: Instance, clock: ManualClock
) -> None:
    for i in range(10):
        await job(instance, f"job-{i}")
    await until(lambda: RUNS.started == ["job-0"], "the first job runs")
    clock.advance(instance.settings.wait_s + 1.0)  # every job's start-by time has passed
    for _ in range(5):
        await asyncio.sleep(0)
    assert RUNS.started == ["job-0"] and RUNS.peak == 1
    await run_through(instance, 10)
    assert RUNS.started == [f"job-{i}" for i in range(10)]
