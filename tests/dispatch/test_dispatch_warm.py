"""The dispatcher's warm path with eager start, in-process over a real job store.

An async handler that finishes in its first step is answered without a task;
one that waits past the deadline still becomes a job that later succeeds;
errors at the first step are counted and leave nothing pending.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from runtime.dispatch.answers import Accepted, Completed
from runtime.errors import Draining, HandlerError
from runtime.instance import Instance
from runtime.jobs.job import JobStatus
from tests.support import running_instance, settings_for

pytestmark = pytest.mark.anyio


@pytest.fixture
async def instance(tmp_path: Path) -> AsyncIterator[Instance]:
    settings = settings_for(
        tmp_path,
        handlers=("tests.handlers.sleepy", "tests.handlers.raises", "handlers.echo"),
    )
    async with running_instance(settings) as inst:
        yield inst


async def test_a_handler_that_never_waits_is_answered_without_a_task(instance: Instance) -> None:
    dispatcher = instance.dispatcher
    outcome = await dispatcher.invoke("echo", {"x": 1}, request_id="r1")
    assert isinstance(outcome, Completed) and outcome.output == {"x": 1}
    assert set(outcome.timings_ms) == {"queue", "run"}
    assert not dispatcher.in_flight and dispatcher.pending["echo"] == 0


async def test_a_warm_handler_past_its_deadline_becomes_a_job_that_succeeds(
    instance: Instance,
) -> None:
    dispatcher = instance.dispatcher
    outcome = await dispatcher.invoke("sleepy", {"s": 0.6}, wait_s=0.3, request_id="r2")
    assert isinstance(outcome, Accepted)
    assert dispatcher.pending["sleepy"] == 1, "the same work goes on behind the job"
    job = await instance.jobs.get(outcome.job.id, key_id=None, wait_s=5.0)
    assert job.status is JobStatus.SUCCEEDED
    assert job.output["slept_s"] == 0.6
    assert not dispatcher.in_flight and dispatcher.pending["sleepy"] == 0


async def test_a_handler_error_is_counted_and_leaves_nothing_pending(instance: Instance) -> None:
    dispatcher = instance.dispatcher
    outcomes = dispatcher.handler_stats("raises").outcomes
    before = outcomes["error"]
    with pytest.raises(HandlerError, match="ValueError: nope"):
        await dispatcher.invoke("raises", {"message": "nope"}, request_id="r3")
    await asyncio.sleep(0)  # the task's done callback (bookkeeping) runs in the next turn
    assert outcomes["error"] == before + 1
    assert not dispatcher.in_flight and dispatcher.pending["raises"] == 0


async def test_a_suspended_async_handler_cut_off_from_outside_is_cancelled_and_settled(
    instance: Instance,
) -> None:
    # The end comes from outside (a drain's abort cancels the outcome): the work
    # settles through its outcome's done callback, which cancels the task still
    # driving it, so the handler stops at its await instead of running on.
    dispatcher = instance.dispatcher
    before = asyncio.all_tasks()
    request = asyncio.ensure_future(
        dispatcher.invoke("sleepy", {"s": 30.0}, wait_s=60.0, request_id="cut")
    )
    for _ in range(100):
        await asyncio.sleep(0)
        if dispatcher.in_flight:
            break
    [outcome] = dispatcher.in_flight
    driving = asyncio.all_tasks() - before - {request}
    assert len(driving) == 1, "the handler suspended: one task drives the rest"
    dispatcher.abort_in_flight()
    with pytest.raises(Draining, match="drained before this request finished"):
        await request
    assert outcome.cancelled()
    assert not dispatcher.in_flight and dispatcher.pending["sleepy"] == 0
    [task] = driving
    for _ in range(3):  # the cancelled task ends on the loop's next turn
        if task.done():
            break
        await asyncio.sleep(0)
    assert task.cancelled(), "stopped at its await, not left sleeping for 30 s"
