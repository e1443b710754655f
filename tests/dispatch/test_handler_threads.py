"""Sync handlers on threads of their own, in-process over a real job store.

A warm sync call goes straight to a handler thread with no task, and past
its deadline the same call becomes a job; handlers filling every handler
thread do not hold up the runtime's own blocking work (a job record); drain
lets go of the models of a call whose thread still runs; a call that must
wait for one of its models takes no early lease; a handler calling
sys.exit() is a handler error, not the server's exit.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from runtime.dispatch.answers import JOB_NOW, Accepted, Completed
from runtime.errors import Draining, HandlerError
from runtime.instance import Instance
from runtime.jobs.job import JobStatus
from runtime.models.lifecycle import State
from tests.handlers import gated, loadlog
from tests.support import SAFETY_S, make_bundle, running_instance, settings_for

pytestmark = pytest.mark.anyio


@pytest.fixture
def gate() -> Iterator[None]:
    gated.GATE.clear()
    gated.ENTERED.clear()
    try:
        yield
    finally:
        gated.GATE.set()  # no handler thread outlives its test


@pytest.fixture
async def instance(tmp_path: Path) -> AsyncIterator[Instance]:
    for name in ("alpha", "beta"):
        make_bundle(tmp_path / "bundles", name)
    settings = settings_for(
        tmp_path,
        handlers=(
            "tests.handlers.gated",
            "tests.handlers.loadlog",
            "tests.handlers.exits",
            "handlers.echo",
        ),
        drain_grace_s=0.1,
    )
    async with running_instance(settings) as inst:
        yield inst


async def until(condition: Callable[[], bool], timeout_s: float = SAFETY_S) -> None:
    """Wait for `condition` (a safety limit against a hang, not a bound on time)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "never happened"
        await asyncio.sleep(0.005)


async def call(instance: Instance, handler: str, event: Any = None) -> Any:
    outcome = await instance.dispatcher.invoke(handler, event or {}, wait_s=60.0, request_id="t")
    assert isinstance(outcome, Completed)
    return outcome.output


async def test_a_warm_sync_call_runs_on_a_handler_thread_with_no_task(
    instance: Instance, gate: None
) -> None:
    dispatcher = instance.dispatcher
    before = asyncio.all_tasks()
    request = asyncio.create_task(dispatcher.invoke("gated", {}, request_id="g1"))
    await until(lambda: gated.ENTERED == ["g1"])
    assert asyncio.all_tasks() - before == {request}, "the request's own task, and no other"
    assert len(dispatcher.in_flight) == 1 and dispatcher.pending["gated"] == 1
    gated.GATE.set()
    outcome = await request
    assert isinstance(outcome, Completed)
    assert outcome.output["thread"].startswith("thaw-handler")
    assert set(outcome.timings_ms) == {"queue", "run"} and outcome.timings_ms["run"] > 0
    assert not dispatcher.in_flight and dispatcher.pending["gated"] == 0
    assert dispatcher.handler_stats("gated").outcomes["sync"] == 1


async def test_a_warm_sync_call_past_its_deadline_becomes_a_job_with_its_output(
    instance: Instance, gate: None
) -> None:
    dispatcher = instance.dispatcher
    outcome = await dispatcher.invoke("gated", {}, wait_s=0.3, request_id="late")
    assert isinstance(outcome, Accepted)
    assert dispatcher.pending["gated"] == 1, "the same call goes on behind the job"
    gated.GATE.set()
    job = await instance.jobs.get(outcome.job.id, key_id=None, wait_s=5.0)
    assert job.status is JobStatus.SUCCEEDED
    assert job.output["thread"].startswith("thaw-handler")
    assert gated.ENTERED == ["late"], "it ran once"
    await until(lambda: not dispatcher.in_flight and dispatcher.pending["gated"] == 0)


async def test_a_sync_handler_error_keeps_its_cause(instance: Instance) -> None:
    # The model is released by the same callback that reports the error.
    await call(instance, "alpha")
    with pytest.raises(HandlerError, match="ValueError") as raised:
        await instance.dispatcher.invoke("alpha", {"sleep_s": "soon"}, request_id="bad")
    assert isinstance(raised.value.__cause__, ValueError)
    assert instance.cache.in_flight("alpha") == 0
    await asyncio.sleep(0)  # the outcome's done callback (bookkeeping) runs in the next turn
    assert instance.dispatcher.handler_stats("alpha").outcomes["error"] == 1
    assert not instance.dispatcher.in_flight and instance.dispatcher.pending["alpha"] == 0


@pytest.mark.parametrize(
    "handler",
    ["exits", "exits_async", "exits_alpha"],
    ids=["sync", "async", "sync-cold-with-a-model"],
)
async def test_a_handler_calling_sys_exit_is_a_handler_error_and_the_instance_serves_on(
    instance: Instance, handler: str
) -> None:
    # On the cold path the handler's thread used to hand SystemExit to the
    # work's task, which re-raises it out of the event loop: the server exited.
    with pytest.raises(HandlerError, match="SystemExit: 3") as raised:
        await instance.dispatcher.invoke(handler, {}, wait_s=60.0, request_id="x")
    assert isinstance(raised.value.__cause__, SystemExit)
    assert await call(instance, "echo", {"still": "serving"}) == {"still": "serving"}


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold"])
async def test_a_sync_call_admitted_as_the_handler_threads_shut_down_is_refused_cleanly(
    instance: Instance, cold: bool
) -> None:
    # The window between admission and a handler thread: a stopping instance
    # shuts its handler threads down after drain, while a job poll may still
    # start recovered work. Unguarded, the call raised out of the dispatcher
    # still holding its model, and stopping the instance waited for it forever.
    if not cold:
        await call(instance, "alpha")
    instance.executor.shutdown()
    with pytest.raises(Draining):
        await instance.dispatcher.invoke("alpha", {}, wait_s=60.0, request_id="late")
    await until(lambda: not instance.dispatcher.in_flight)
    assert instance.dispatcher.pending["alpha"] == 0
    assert instance.cache.in_flight("alpha") == 0


async def test_handlers_filling_every_handler_thread_do_not_hold_up_a_job_record(
    instance: Instance, gate: None
) -> None:
    dispatcher = instance.dispatcher
    requests = [
        asyncio.create_task(dispatcher.invoke("gated", {}, wait_s=60.0, request_id=f"g{i}"))
        for i in range(64)
    ]
    try:
        await until(lambda: len(gated.ENTERED) == 64)
        # A job record is a store write on the runtime's own threads.
        accepted = await asyncio.wait_for(
            dispatcher.invoke("echo", {"x": 1}, policy=JOB_NOW, request_id="e1"), 5.0
        )
        assert isinstance(accepted, Accepted)
    finally:
        gated.GATE.set()
    outcomes = await asyncio.gather(*requests)
    assert all(isinstance(o, Completed) for o in outcomes)
    assert len({o.output["thread"] for o in outcomes if isinstance(o, Completed)}) == 64


def is_work_item(frame: FrameType) -> bool:
    code = frame.f_code
    return code.co_name == "run" and code.co_filename.endswith("concurrent/futures/thread.py")


def frames_of(threads: set[int] | None = None) -> dict[int, list[FrameType]]:
    """Each thread's frames (of `threads`, or of all), innermost out."""
    found: dict[int, list[FrameType]] = {}
    for ident, frame in sys._current_frames().items():
        if threads is not None and ident not in threads:
            continue
        walk: FrameType | None = frame
        while walk is not None:
            found.setdefault(ident, []).append(walk)
            walk = walk.f_back
    return found


def handler_threads() -> set[int]:
    """The threads inside the `_view` handler now. Only those: the suite's other
    work (the container image build runs on a thread pool of its own) is not the
    handler's."""
    return {
        ident
        for ident, frames in frames_of().items()
        if any(f.f_code.co_name == "_view" for f in frames)
    }


async def test_drain_lets_go_of_the_model_of_a_sync_call_whose_thread_still_runs(
    instance: Instance, caplog: pytest.LogCaptureFixture
) -> None:
    await call(instance, "alpha")
    entry = instance.cache.entries["alpha"]
    loadlog.HOLD.clear()  # the handler holds its thread until the test lets it go
    try:
        request = asyncio.create_task(
            instance.dispatcher.invoke("alpha", {"hold": True}, wait_s=60.0, request_id="slow")
        )
        await until(lambda: instance.cache.in_flight("alpha") == 1 and bool(handler_threads()))
        with caplog.at_level(logging.WARNING):
            await instance.stop()
            # The drain did not wait for the handler: its thread is still in it.
            running = handler_threads()
            assert running
            assert entry.lifecycle.state is State.UNLOADED
            assert instance.cache.in_flight("alpha") == 0
            with pytest.raises(Draining, match="drained before this request finished"):
                await request  # a waiting caller cut off by the drain gets 503 `drained`
            loadlog.HOLD.set()
            # The thread ends: its work item (concurrent.futures' `_WorkItem.run`, which
            # posts the outcome back to the loop) is done, and the loop drops the outcome.
            await until(
                lambda: not any(is_work_item(f) for fs in frames_of(running).values() for f in fs)
            )
            for _ in range(3):
                await asyncio.sleep(0)
    finally:
        loadlog.HOLD.set()  # no handler thread outlives its test
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_call_that_must_wait_for_one_of_its_models_takes_no_early_lease(
    instance: Instance,
) -> None:
    await call(instance, "alpha")
    alpha = instance.cache.entries["alpha"]
    hits = alpha.hits
    assert await call(instance, "pair") == {"bundles": ["alpha", "beta"]}  # beta loads first
    assert alpha.hits == hits + 1, "one lease on alpha, not one taken early and one again"
    assert await call(instance, "pair") == {"bundles": ["alpha", "beta"]}  # both warm
    assert alpha.hits == hits + 2
    assert instance.cache.in_flight("alpha") == 0 and instance.cache.in_flight("beta") == 0
