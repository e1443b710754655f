"""Dynamic batching through the dispatcher, in-process over a real job store.

The handlers are tests/handlers/batched.py. A batch is held open by an event
that waits in its thread for `GATE`: the requests arriving meanwhile queue
behind it (one run slot per handler), so which requests share a batch is
decided by the order of events, never by timing. No assertion bounds a
duration: `settle` only guards against a hang.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime.dispatch.answers import JOB_NOW, Accepted, Completed
from runtime.dispatch.batcher import Member, due_at
from runtime.dispatch.dispatcher import Dispatcher
from runtime.errors import HandlerError, InvalidInput
from runtime.instance import Instance
from runtime.jobs.job import JobStatus
from runtime.registry import Batch
from tests.handlers import batched
from tests.support import make_bundle, running_instance, settings_for

pytestmark = pytest.mark.anyio

PER_REQUEST_BYTES = 1 << 20
WEIGHTS_BYTES = 1 << 20
SLOTS = 3  # requests of `ledger` the memory budget admits at once


@pytest.fixture(autouse=True)
def gate() -> Iterator[None]:
    batched.GATE.clear()
    batched.BATCHES.clear()
    yield
    batched.GATE.set()  # no handler thread outlives its test


@pytest.fixture
async def instance(tmp_path: Path) -> AsyncIterator[Instance]:
    root = tmp_path / "bundles"
    make_bundle(root, "ledger", per_request_bytes=PER_REQUEST_BYTES, weights_bytes=WEIGHTS_BYTES)
    settings = settings_for(
        tmp_path,
        handlers=("tests.handlers.batched",),
        memory_budget=WEIGHTS_BYTES + SLOTS * PER_REQUEST_BYTES,
    )
    async with running_instance(settings) as inst:
        yield inst


async def settle(done: Callable[[], bool], what: str) -> None:
    """Yield to the loop until `done()`; a hang guard, not a time bound."""
    for _ in range(20_000):
        if done():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never: {what}")


def invoke(dispatcher: Dispatcher, handler: str, event: Any, **kw: Any) -> asyncio.Task[Any]:
    kw.setdefault("wait_s", 30.0)
    kw.setdefault("request_id", f"req-{event.get('id')}")
    return asyncio.ensure_future(dispatcher.invoke(handler, event, **kw))


async def hold_first(dispatcher: Dispatcher, handler: str = "batch_gated") -> asyncio.Task[Any]:
    """A request whose batch runs, alone, until the gate opens."""
    held = invoke(dispatcher, handler, {"id": 0, "hold": True})
    await settle(
        lambda: dispatcher.pending[handler] == 1 and dispatcher.batcher.queued(handler) == 0,
        "the held batch runs",
    )
    return held


def queued_is(dispatcher: Dispatcher, handler: str, count: int) -> Callable[[], bool]:
    return lambda: dispatcher.batcher.queued(handler) == count


async def queue_behind(
    dispatcher: Dispatcher, events: list[dict[str, Any]], handler: str = "batch_gated", **kw: Any
) -> list[asyncio.Task[Any]]:
    """Each request in turn, once the one before it is queued."""
    tasks = []
    for event in events:
        count = dispatcher.batcher.queued(handler) + 1
        tasks.append(invoke(dispatcher, handler, event, **kw))
        await settle(queued_is(dispatcher, handler, count), "the request queues")
    return tasks


# ---- the rule, with plain numbers --------------------------------------------------


def member(queued_at: float, start_by: float = math.inf) -> Member:
    # Only the times matter to the rule: no work, event or models.
    return Member(None, None, [], queued_at, start_by)  # type: ignore[arg-type]


def test_due_rule() -> None:
    policy = Batch(max_size=4, max_wait_ms=10, max_concurrent=1)
    alone = [member(100.0)]
    assert due_at(policy, [], 0, 1) == math.inf
    # Idle, after a batch of one: one caller in flight runs at once.
    assert due_at(policy, alone, 0, 1) == -math.inf
    # After a batch of three, a lone request waits for that company, max_wait at most.
    assert due_at(policy, alone, 0, 3) == pytest.approx(100.010)
    three = [member(100.0), member(100.001), member(100.002)]
    assert due_at(policy, three, 0, 3) == -math.inf
    # Never more than max_size expected.
    assert due_at(policy, [*three, member(100.003)], 0, 9) == -math.inf
    # The run slot is taken: nothing starts another batch, not even a deadline.
    assert due_at(policy, three, 1, 3) == math.inf
    near = [member(100.0), member(100.001, start_by=100.004)]
    assert due_at(policy, near, 1, 3) == math.inf
    # A free slot: a member's deadline does not wait for company.
    assert due_at(policy, near, 0, 3) == 100.004
    assert due_at(Batch(max_concurrent=2), three, 1, 9) == pytest.approx(100.005)


def test_policy_is_checked() -> None:
    for bad in ({"max_size": 0}, {"max_concurrent": 0}, {"max_wait_ms": -1.0}):
        with pytest.raises(ValueError):
            Batch(**bad)  # type: ignore[arg-type]


# ---- batches through the dispatcher --------------------------------------------------


async def test_requests_queued_behind_a_batch_run_together_in_arrival_order(
    instance: Instance,
) -> None:
    dispatcher = instance.dispatcher
    held = await hold_first(dispatcher)
    queued = await queue_behind(dispatcher, [{"id": i} for i in (1, 2, 3, 4)])
    batched.GATE.set()
    outcomes = await asyncio.gather(held, *queued)
    assert all(isinstance(o, Completed) for o in outcomes)
    assert batched.BATCHES == [[0], [1, 2, 3, 4]]
    for i, outcome in enumerate(outcomes[1:], start=1):
        assert outcome.output == {
            "id": i,
            "batch": [1, 2, 3, 4],
            "size": 4,
            "request_id": f"req-{i}",
        }
        assert outcome.batch_size == 4
        assert list(outcome.timings_ms) == ["queue", "batch", "run"]
    assert outcomes[0].batch_size == 1
    assert not dispatcher.in_flight and dispatcher.pending["batch_gated"] == 0
    metrics = instance.metrics.render().decode()
    assert 'thaw_batch_size_count{handler="batch_gated"} 2.0' in metrics
    assert 'thaw_batch_size_sum{handler="batch_gated"} 5.0' in metrics
    assert 'thaw_batch_wait_seconds_count{handler="batch_gated"} 5.0' in metrics


async def test_an_item_error_fails_only_its_own_caller(instance: Instance) -> None:
    dispatcher = instance.dispatcher
    outcomes = dispatcher.handler_stats("batch_gated").outcomes
    before = dict(outcomes)
    held = await hold_first(dispatcher)
    events = [{"id": 1}, {"id": 2, "refuse": "colour"}, {"id": 3, "fail": "boom"}, {"id": 4}]
    queued = await queue_behind(dispatcher, events)
    batched.GATE.set()
    await held
    first, refused, failed, last = await asyncio.gather(*queued, return_exceptions=True)
    assert batched.BATCHES[-1] == [1, 2, 3, 4]
    assert isinstance(first, Completed) and first.output["id"] == 1
    assert isinstance(last, Completed) and last.output["id"] == 4
    assert isinstance(refused, InvalidInput) and refused.status == 400
    assert refused.field == "colour"
    assert isinstance(failed, HandlerError) and failed.status == 500
    assert "ValueError: boom" in str(failed)
    await asyncio.sleep(0)  # done callbacks (bookkeeping) run in the next turn
    assert outcomes["client_error"] == before["client_error"] + 1
    assert outcomes["error"] == before["error"] + 1
    assert outcomes["sync"] == before["sync"] + 3


@pytest.mark.parametrize(
    ("handler", "message"),
    [("batch_raises", "ValueError: the whole batch"), ("batch_miscounts", "outputs for")],
)
async def test_a_failed_batch_fails_every_member_with_handler_error(
    instance: Instance, handler: str, message: str
) -> None:
    dispatcher = instance.dispatcher
    results = await asyncio.gather(
        *(invoke(dispatcher, handler, {"id": i}) for i in range(5)), return_exceptions=True
    )
    for result in results:
        assert isinstance(result, HandlerError), result
        assert result.status == 500 and message in str(result)
    await asyncio.sleep(0)
    assert not dispatcher.in_flight and dispatcher.pending[handler] == 0


async def test_async_handlers_batch_and_answer_each_caller(instance: Instance) -> None:
    dispatcher = instance.dispatcher
    outcomes = await asyncio.gather(
        *(invoke(dispatcher, "batch_async", {"id": i}) for i in range(6))
    )
    for i, outcome in enumerate(outcomes):
        assert isinstance(outcome, Completed)
        assert outcome.output["id"] == i and outcome.output["request_id"] == f"req-{i}"
    assert sorted(i for batch in batched.BATCHES for i in batch) == list(range(6))


async def test_an_async_batch_calling_sys_exit_fails_its_batch_not_the_server(
    instance: Instance,
) -> None:
    dispatcher = instance.dispatcher
    with pytest.raises(HandlerError, match="SystemExit"):
        await dispatcher.invoke("batch_async", {"id": 1, "exit": True}, request_id="r1")
    after = await dispatcher.invoke("batch_async", {"id": 2}, request_id="r2")
    assert isinstance(after, Completed) and after.output["id"] == 2


async def test_a_request_near_its_deadline_never_starts_beside_the_running_batch(
    instance: Instance,
) -> None:
    """The run slot is taken and max_wait is a minute: the last request's deadline
    comes while it waits for the slot. It is answered 202, and its member stays
    queued: it runs once, after the held batch, with the company waiting."""
    dispatcher = instance.dispatcher
    held = await hold_first(dispatcher)
    [patient] = await queue_behind(dispatcher, [{"id": 1}])
    urgent = await dispatcher.invoke("batch_gated", {"id": 2}, wait_s=0.5, request_id="req-2")
    assert isinstance(urgent, Accepted), "answered before its deadline, with its job"
    assert batched.BATCHES == [], "nothing ran (and ended) beside the held batch"
    assert not held.done() and not patient.done()
    batched.GATE.set()
    assert (await held).output["batch"] == [0]
    assert (await patient).output["batch"] == [1, 2]
    done = await instance.jobs.get(urgent.job.id, key_id=None, wait_s=10.0)
    assert done.status is JobStatus.SUCCEEDED and done.output["batch"] == [1, 2]
    assert batched.BATCHES == [[0], [1, 2]], "the urgent request ran once"


async def test_jobs_batch_with_sync_requests(instance: Instance) -> None:
    dispatcher = instance.dispatcher
    held = await hold_first(dispatcher)
    jobs = await queue_behind(dispatcher, [{"id": 1}, {"id": 2}], policy=JOB_NOW)
    accepted = [await job for job in jobs]
    assert all(isinstance(a, Accepted) for a in accepted)
    [sync] = await queue_behind(dispatcher, [{"id": 3}])
    batched.GATE.set()
    await held
    assert (await sync).output["batch"] == [1, 2, 3]
    for i, job in enumerate(accepted, start=1):
        done = await instance.jobs.get(job.job.id, key_id=None, wait_s=10.0)
        assert done.status is JobStatus.SUCCEEDED
        assert done.output == {"id": i, "batch": [1, 2, 3], "size": 3, "request_id": f"req-{i}"}


async def test_a_batch_holds_one_admission_slot_per_member(instance: Instance) -> None:
    """The budget admits SLOTS requests of `ledger`; a batch is formed only from
    admitted requests, so it never holds more than the budget."""
    dispatcher = instance.dispatcher
    budget = instance.cache.budget
    warm = await dispatcher.invoke("batch_ledger", {"id": -1}, wait_s=30, request_id="warm")
    assert isinstance(warm, Completed)  # loaded: READY from here on
    batched.BATCHES.clear()
    held = await hold_first(dispatcher, "batch_ledger")
    rest = [invoke(dispatcher, "batch_ledger", {"id": i}) for i in range(1, 9)]
    await settle(lambda: budget.waiting("ledger") == 8 - (SLOTS - 1), "the rest wait for memory")
    assert dispatcher.batcher.queued("batch_ledger") == SLOTS - 1
    assert budget.limit is not None and budget.reserved_bytes() <= budget.limit
    batched.GATE.set()
    outcomes = await asyncio.gather(held, *rest)
    assert all(isinstance(o, Completed) for o in outcomes)
    sizes = [len(b) for b in batched.BATCHES]
    assert sum(sizes) == 9 and max(sizes) <= SLOTS and max(sizes) > 1, sizes
    assert sorted(i for b in batched.BATCHES for i in b) == list(range(9))
    assert budget.reserved_bytes() == WEIGHTS_BYTES + PER_REQUEST_BYTES


async def test_drain_cuts_off_a_queued_member_without_running_it(instance: Instance) -> None:
    dispatcher = instance.dispatcher
    held = await hold_first(dispatcher)
    [queued] = await queue_behind(dispatcher, [{"id": 1}])
    dispatcher.abort_in_flight()
    batched.GATE.set()
    results = await asyncio.gather(held, queued, return_exceptions=True)
    assert all(isinstance(r, Exception) and "drain" in str(r) for r in results), results
    await settle(lambda: dispatcher.batcher.running("batch_gated") == 0, "the held batch ends")
    assert batched.BATCHES == [[0]], "the cut-off member never ran"
    assert dispatcher.batcher.queued("batch_gated") == 0
