"""The memory budget on its own: grants in arrival order, bounded passing, nobody
left waiting, and what a waiter that gives up leaves behind.

A fake evictor stands in for the cache: it evicts the idle bundles it is told
about, in the order given.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from runtime.clock import ManualClock
from runtime.errors import InsufficientMemory
from runtime.models.budget import MAX_BYPASS, MemoryBudget


class FakeEvictor:
    def __init__(self, budget: MemoryBudget) -> None:
        self.budget = budget
        self.idle: list[str] = []  # evictable, in eviction order
        self.pinned_bytes = 0
        self.is_busy = False
        self.evicted: list[str] = []
        budget.bind(self)

    def evict_for(self, need_bytes: int, exclude: str) -> bool:
        budget = self.budget
        assert budget.limit is not None
        evicted = False
        for name in [n for n in self.idle if n != exclude]:
            if budget.reserved_bytes() + need_bytes <= budget.limit:
                break
            self.idle.remove(name)
            self.evicted.append(name)
            budget.unreserve(name)
            evicted = True
        return evicted

    def unevictable_bytes(self, exclude: str) -> int:
        return self.pinned_bytes

    def busy(self) -> bool:
        return self.is_busy


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_requests_waiting_for_a_slot_are_granted_in_arrival_order() -> None:
    async def scenario() -> None:
        budget = MemoryBudget(100)
        FakeEvictor(budget)
        await budget.reserve("a", 40, 30)  # weights + one slot = 70; a second slot: 100
        assert budget.try_admit("a") and budget.try_admit("a")
        order: list[int] = []

        async def request(i: int) -> None:
            assert await budget.admit("a")
            order.append(i)

        waiters = [asyncio.ensure_future(request(i)) for i in range(6)]
        await settle()
        assert order == [] and budget.waiting() == 6
        for expected in range(6):
            budget.release("a")  # one slot frees: the oldest waiter has it, nobody else
            await settle()
            assert order == list(range(expected + 1))
        await asyncio.gather(*waiters)
        assert budget.admitted("a") == 2 and budget.waiting() == 0

    run(scenario)


def test_the_first_request_of_an_idle_bundle_never_waits() -> None:
    """It adds no bytes (every reservation holds one slot), so it passes the queue:
    the reproduction of issue 15 item 1 had waiters re-check with a formula that
    charged it a second slot, and nobody was ever woken."""

    async def scenario() -> None:
        budget = MemoryBudget(100)
        FakeEvictor(budget)
        await budget.reserve("a", 60, 30)  # 90: exactly one request at a time
        assert budget.try_admit("a")
        second = asyncio.ensure_future(budget.admit("a"))
        await settle()
        assert not second.done()
        budget.release("a")
        await settle()
        assert second.done() and second.result() is True
        assert budget.admitted("a") == 1 and budget.reserved_bytes() == 90

    run(scenario)


def test_a_smaller_waiter_passes_one_that_does_not_fit_but_only_so_often() -> None:
    async def scenario() -> None:
        budget = MemoryBudget(100)
        evictor = FakeEvictor(budget)
        evictor.is_busy = True  # the big load is not hopeless: something may free room
        await budget.reserve("a", 50, 10)
        assert budget.try_admit("a")
        big = asyncio.ensure_future(budget.reserve("big", 50, 0))  # 60 + 50 > 100
        await settle()
        assert not big.done()
        passed = 0
        # Small requests keep coming and fit beside `a`; each passes `big` ...
        while passed < MAX_BYPASS:
            assert await asyncio.wait_for(budget.admit("a"), 1)
            budget.release("a")
            passed += 1
        # ... until `big` was passed over enough: now they queue behind it.
        late = asyncio.ensure_future(budget.admit("a"))
        await settle()
        assert not late.done() and not big.done()
        # `a` goes idle, so evictable: `big` is served first, by evicting it, and the
        # request queued behind `big` goes round again (its bundle left memory).
        evictor.idle = ["a"]
        budget.release("a")
        await settle()
        assert big.done() and budget.reservation("big") is not None
        assert evictor.evicted == ["a"] and late.result() is False

    run(scenario)


def test_eviction_makes_room_for_the_head_of_the_queue() -> None:
    async def scenario() -> None:
        budget = MemoryBudget(100)
        evictor = FakeEvictor(budget)
        await budget.reserve("old", 60, 0)
        evictor.idle = ["old"]
        await budget.reserve("new", 50, 0)
        assert evictor.evicted == ["old"]
        assert budget.reservation("old") is None and budget.reserved_bytes() == 50

    run(scenario)


def test_a_load_that_can_never_fit_fails_at_once() -> None:
    async def scenario() -> None:
        budget = MemoryBudget(100)
        evictor = FakeEvictor(budget)
        with pytest.raises(InsufficientMemory, match="whole memory budget"):
            await budget.reserve("huge", 90, 20)
        evictor.pinned_bytes = 60
        with pytest.raises(InsufficientMemory, match="pinned"):
            await budget.reserve("big", 50, 0)
        assert budget.waiting() == 0

    run(scenario)


def test_a_queued_load_fails_when_nothing_could_ever_free_room() -> None:
    """Nothing admitted, nothing loading, and eviction declines: waiting would be forever."""

    async def scenario() -> None:
        budget = MemoryBudget(100)
        evictor = FakeEvictor(budget)
        await budget.reserve("held", 70, 0)  # resident, but not evictable (pinned-like)
        evictor.is_busy = True
        load = asyncio.ensure_future(budget.reserve("next", 40, 0))
        await settle()
        assert not load.done()  # something may still free room
        evictor.is_busy = False
        budget.reconsider()
        await settle()
        with pytest.raises(InsufficientMemory):
            load.result()
        assert budget.waiting() == 0

    run(scenario)


def test_an_unloading_bundle_turns_its_queued_requests_away() -> None:
    async def scenario() -> None:
        budget = MemoryBudget(100)
        FakeEvictor(budget)
        await budget.reserve("a", 60, 30)
        assert budget.try_admit("a")
        queued = asyncio.ensure_future(budget.admit("a"))
        await settle()
        budget.close("a")
        await settle()
        assert queued.result() is False  # goes round: waits for the unload, loads again
        assert not budget.try_admit("a")
        idle = asyncio.ensure_future(budget.idle("a"))
        await settle()
        assert not idle.done()
        budget.release("a")
        await settle()
        assert idle.done()

    run(scenario)


def test_a_waiter_that_gives_up_leaves_nothing_behind() -> None:
    async def scenario() -> None:
        budget = MemoryBudget(100)
        FakeEvictor(budget)
        await budget.reserve("a", 60, 30)
        assert budget.try_admit("a")
        gives_up = asyncio.ensure_future(budget.admit("a"))
        then = asyncio.ensure_future(budget.admit("a"))
        await settle()
        gives_up.cancel()
        await settle()
        assert budget.waiting() == 1
        budget.release("a")
        await settle()
        assert then.result() is True and budget.admitted("a") == 1

        # Granted, then cancelled before it resumed: the grant is given back.
        late = asyncio.ensure_future(budget.admit("a"))
        await settle()
        budget.release("a")  # grants `late` ...
        late.cancel()  # ... which is cancelled before it runs again
        await settle()
        assert budget.admitted("a") == 0 and budget.waiting() == 0

    run(scenario)


def test_no_limit_admits_everything_until_one_is_set() -> None:
    async def scenario() -> None:
        budget = MemoryBudget(None)
        FakeEvictor(budget)
        await budget.reserve("a", 10**12, 10**9)
        assert all(budget.try_admit("a") for _ in range(100))
        budget.set_limit(10**12 + 10**9)
        assert not budget.try_admit("a")

    run(scenario)


def test_the_oldest_wait_is_timed_on_the_budgets_clock() -> None:
    async def scenario() -> None:
        clock = ManualClock()
        budget = MemoryBudget(100, clock=clock)
        FakeEvictor(budget)
        await budget.reserve("a", 60, 30)
        assert budget.try_admit("a")
        assert budget.oldest_wait_s() == 0.0
        first = asyncio.ensure_future(budget.admit("a"))
        await settle()
        clock.advance(3.0)
        second = asyncio.ensure_future(budget.admit("a"))
        await settle()
        clock.advance(4.0)
        assert budget.oldest_wait_s() == pytest.approx(7.0)  # the head of the queue's
        budget.release("a")
        await settle()
        assert first.done() and budget.oldest_wait_s() == pytest.approx(4.0)
        budget.release("a")
        await settle()
        assert second.done() and budget.oldest_wait_s() == 0.0

    run(scenario)
