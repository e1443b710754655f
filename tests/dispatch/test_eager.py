"""Eager start: a coroutine's first step runs at once; a task only if it waits."""

from __future__ import annotations

import asyncio
import contextvars

import pytest

from runtime.dispatch import eager

pytestmark = pytest.mark.anyio

var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")


async def test_a_coroutine_that_never_waits_is_done_at_once_without_a_task() -> None:
    steps: list[str] = []

    async def quick() -> int:
        steps.append("ran")
        return 7

    before = len(asyncio.all_tasks())
    future = eager.start(quick())
    assert steps == ["ran"], "the first step runs inside start()"
    assert future.done() and future.result() == 7
    assert not isinstance(future, asyncio.Task)
    assert len(asyncio.all_tasks()) == before


async def test_a_coroutine_that_waits_goes_on_in_a_task_to_its_result() -> None:
    steps: list[str] = []

    async def slow() -> str:
        steps.append("first")
        await asyncio.sleep(0.01)
        steps.append("second")
        await asyncio.sleep(0)  # a bare yield, too
        return "done"

    future = eager.start(slow())
    assert steps == ["first"] and isinstance(future, asyncio.Task) and not future.done()
    assert await future == "done"
    assert steps == ["first", "second"]


async def test_errors_at_either_step_reach_the_future() -> None:
    async def fails_at_once() -> None:
        raise ValueError("first step")

    async def fails_later() -> None:
        await asyncio.sleep(0.01)
        raise KeyError("later")

    early = eager.start(fails_at_once())
    assert early.done()
    with pytest.raises(ValueError, match="first step"):
        early.result()
    with pytest.raises(KeyError, match="later"):
        await eager.start(fails_later())


async def test_cancelling_the_task_reaches_the_coroutine_and_runs_its_cleanup() -> None:
    cleaned: list[str] = []
    started = asyncio.Event()

    async def long() -> None:
        try:
            started.set()
            await asyncio.sleep(30)
        finally:
            cleaned.append("finally")

    future = eager.start(long())
    await started.wait()
    future.cancel()
    with pytest.raises(asyncio.CancelledError):
        await future
    assert cleaned == ["finally"]

    # Cancelled before the task ever stepped: the suspended coroutine still unwinds.
    cleaned.clear()
    future = eager.start(long())
    future.cancel()
    with pytest.raises(asyncio.CancelledError):
        await future
    assert cleaned == ["finally"]


async def test_the_coroutine_runs_in_its_own_copy_of_the_context() -> None:
    async def sets() -> str:
        var.set("inside")
        await asyncio.sleep(0)
        return var.get()

    var.set("caller")
    assert await eager.start(sets()) == "inside", "its later steps see its own changes"
    assert var.get() == "caller", "the caller's context is untouched"


async def test_the_suspended_coroutine_can_also_be_awaited_directly() -> None:
    async def slow() -> int:
        await asyncio.sleep(0.01)
        return 3

    coro = slow()
    pending = coro.send(None)
    assert await eager._Suspended(coro, pending) == 3
