"""The fleet's parts below the job manager, on a real PostgreSQL: the queue figures
/metrics exports, liveness held in `thaw_owners` (who is dead, and never a
living owner nor anyone right after an outage), and wake-ups carried by
LISTEN/NOTIFY to the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from runtime.clock import SYSTEM, ManualClock
from runtime.errors import StorageUnavailable
from runtime.jobs.job import Job, new_job_id
from runtime.jobs.liveness import Liveness
from runtime.jobs.stores.postgres import PostgresJobStore
from runtime.jobs.wakeups import Event, Wakeups
from tests.jobs import postgres_fixtures
from tests.support import SAFETY_S

pytestmark = pytest.mark.anyio

postgres_cluster = postgres_fixtures.postgres_cluster
_postgres_session_database = postgres_fixtures._postgres_session_database
postgres_database = postgres_fixtures.postgres_database

LEASE_S = 30.0


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def dsn(postgres_cluster: postgres_fixtures.PostgresCluster, postgres_database: str) -> str:
    return postgres_cluster.dsn(postgres_database)


@pytest.fixture
def store(dsn: str, clock: ManualClock) -> Iterator[PostgresJobStore]:
    opened = PostgresJobStore(dsn, ttl_s=3600, clock=clock)
    yield opened
    opened.close()


def job(handler: str) -> Job:
    return Job(id=new_job_id(), handler=handler, input={})


def test_queue_figures_count_queued_jobs_per_handler_with_the_oldest(
    store: PostgresJobStore, clock: ManualClock
) -> None:
    assert store.queue_figures() == {}
    first = clock.wall()
    store.create(job("a"))
    clock.advance(2)
    store.create(job("a"))
    store.create(job("b"))
    running = job("b")
    store.create(running)
    assert store.claim(running.id, "x", LEASE_S, 3) is not None
    assert store.queue_figures() == {"a": (2, first), "b": (1, first + 2)}


def living(store: PostgresJobStore, clock: ManualClock, owner: str) -> Liveness:
    return Liveness(store, owner=owner, clock=clock, ping_s=1.0, dead_after_s=5.0)


def test_an_owner_silent_past_the_limit_with_running_jobs_is_dead(
    store: PostgresJobStore, clock: ManualClock
) -> None:
    me, other, idle = (living(store, clock, name) for name in ("me", "other", "idle"))
    held = job("a")
    store.create(held)
    assert store.claim(held.id, "other", LEASE_S, 3) is not None
    for _ in range(6):
        for liveness in (me, other, idle):
            liveness.beat()
        clock.advance(1)
    assert me.judging
    assert me.dead() == []  # everyone pinged within the limit
    # `other` stops pinging (SIGKILL); `idle` stops too, but holds no job.
    for _ in range(4):
        me.beat()
        clock.advance(1)
    assert me.dead() == []  # silent for exactly the limit: not past it
    me.beat()
    clock.advance(0.5)
    assert me.dead() == ["other"]
    assert other.dead() == []  # never itself


def test_nobody_is_judged_until_the_judges_own_pings_held_for_the_limit(
    store: PostgresJobStore, clock: ManualClock
) -> None:
    held = job("a")
    store.create(held)
    assert store.claim(held.id, "other", LEASE_S, 3) is not None
    living(store, clock, "other").beat()
    clock.advance(60)  # a long outage: nobody could ping
    me = living(store, clock, "me")
    for _ in range(5):
        me.beat()
        assert me.dead() == []  # `other` had no chance to ping yet
        clock.advance(1)
    assert me.judging
    assert me.dead() == ["other"]


def test_a_failed_ping_breaks_the_run(
    postgres_cluster: postgres_fixtures.PostgresCluster, clock: ManualClock
) -> None:
    dead_end = PostgresJobStore(
        f"postgresql://thaw@127.0.0.1:{postgres_fixtures.free_port()}/x", ttl_s=60, clock=clock
    )
    try:
        me = living(dead_end, clock, "me")  # type: ignore[arg-type]
        with pytest.raises(StorageUnavailable):
            me.beat()
        assert not me.judging and me.dead() == []
        assert isinstance(me.failure, StorageUnavailable)  # for the loop to report
    finally:
        dead_end.close()


def test_pings_further_apart_than_the_limit_start_a_new_run(
    store: PostgresJobStore, clock: ManualClock
) -> None:
    me = living(store, clock, "me")
    for _ in range(6):
        me.beat()
        clock.advance(1)
    assert me.judging
    clock.advance(10)  # this process was stopped (SIGSTOP, a starved loop)
    me.beat()
    assert not me.judging


async def test_a_wait_wakes_when_the_job_changes_through_another_store(dsn: str) -> None:
    # Two stores: two instances, each with its own listening session.
    here = PostgresJobStore(dsn, ttl_s=3600, clock=SYSTEM)
    there = PostgresJobStore(dsn, ttl_s=3600, clock=SYSTEM)
    wakeups = Wakeups(SYSTEM)
    heard: list[Event | None] = []
    wakeups.subscribe(heard.append)
    try:
        wakeups.start(here)
        assert wakeups.supported
        listener = here._listeners[0]
        assert await asyncio.to_thread(listener.listening.wait, 30)
        target, other = job("a"), job("a")
        await asyncio.to_thread(there.create, target)
        await asyncio.to_thread(there.create, other)
        # The creates' own notifications first: heard late (a loaded machine), the
        # target's would wake the wait below before the change it waits for.
        created = {target.id, other.id}
        for _ in range(int(SAFETY_S / 0.01)):
            if created <= {e.job_id for e in heard if e is not None}:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError(f"the creates were never heard: {heard}")
        waiting = asyncio.ensure_future(wakeups.wait(target.id, 30))
        await asyncio.sleep(0)
        assert wakeups.waiting(target.id) == 1
        await asyncio.to_thread(there.claim, other.id, "there", LEASE_S, 3)
        # Heard once its waiters were woken (`Wakeups.deliver`): a wrong wake is
        # done by then, and the waiting task resumes on the loop's next turns.
        for _ in range(int(SAFETY_S / 0.01)):
            if (other.id, "running") in {(e.job_id, e.status) for e in heard if e is not None}:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError(f"the claim was never heard: {heard}")
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiting.done()  # another job's change wakes nobody here
        await asyncio.to_thread(there.cancel, target.id)
        assert await waiting is True
        assert wakeups.waiting(target.id) == 0
        statuses = [(e.job_id, e.status) for e in heard if e is not None]
        assert statuses[-2:] == [(other.id, "running"), (target.id, "cancelled")]
    finally:
        wakeups.close()
        here.close()
        there.close()


async def test_a_wait_without_events_times_out_on_the_clock() -> None:
    clock = ManualClock()
    wakeups = Wakeups(clock)
    wakeups.start(object())  # a store that cannot listen
    assert not wakeups.supported
    waiting = asyncio.ensure_future(wakeups.wait("j", 5))
    await asyncio.sleep(0)
    clock.advance(4.9)
    await asyncio.sleep(0)
    assert not waiting.done()
    clock.advance(0.2)
    assert await waiting is False


async def test_a_gap_wakes_every_waiter_and_tells_subscribers() -> None:
    wakeups = Wakeups(ManualClock())
    heard: list[Event | None] = []
    wakeups.subscribe(heard.append)
    waits = [asyncio.ensure_future(wakeups.wait(name, 60)) for name in ("a", "b")]
    await asyncio.sleep(0)
    wakeups.deliver(None)
    assert await asyncio.gather(*waits) == [True, True]
    assert heard == [None]


def test_claim_next_takes_only_jobs_queued_before_a_time_when_asked(
    store: PostgresJobStore, clock: ManualClock
) -> None:
    old = job("a")
    store.create(old)
    clock.advance(20)
    young = job("a")
    store.create(young)
    cutoff = clock.wall() - 10
    first = store.claim_next("me", LEASE_S, 3, ["a"], queued_before=cutoff)
    assert first is not None and first.id == old.id
    assert store.claim_next("me", LEASE_S, 3, ["a"], queued_before=cutoff) is None
    second = store.claim_next("me", LEASE_S, 3, ["a"])
    assert second is not None and second.id == young.id
