"""The job manager over a real SQLite store: leases, phases, outcomes, cancellation, drain.

The manager and its store share a `ManualClock`: heartbeats are due when the
test advances it, and work takes the time the test gives it. Store calls run
in real threads, so a test waits (polls) for their effect before it moves on.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from runtime.clock import ManualClock
from runtime.errors import LoadFailed, UnknownJob
from runtime.jobs.job import Job, JobStatus
from runtime.jobs.manager import JobManager
from runtime.jobs.stores.sqlite import SQLiteJobStore
from runtime.telemetry.metrics import Metrics
from tests.inproc import until

pytestmark = pytest.mark.anyio

LEASE_S = 30.0
BEAT_S = LEASE_S / 3  # the manager's heartbeat interval
# A safety limit on waiting for real threads (store calls), never a bound under test.
SAFETY_S = 30.0


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def store(tmp_path: Path, clock: ManualClock) -> SQLiteJobStore:
    return SQLiteJobStore(tmp_path / "jobs.sqlite3", ttl_s=600.0, clock=clock)


def manager(store: SQLiteJobStore) -> JobManager:
    return JobManager(
        store,
        owner="here",
        lease_s=LEASE_S,
        max_attempts=2,
        metrics=Metrics(),
        clock=store.clock,
    )


async def finishes(clock: ManualClock, value: Any, after_s: float) -> Any:
    await clock.sleep(after_s)
    return value


async def advance(clock: ManualClock, seconds: float, armed: int) -> None:
    """Move time once `armed` timers wait on the clock: the heartbeat loop and the
    works have gone back to sleep, so none of them misses the step."""
    await until(lambda: clock.pending >= armed, f"{armed} timers armed")
    clock.advance(seconds)


async def tasks_back_to(count: int) -> bool:
    """Whether the running tasks fall back to `count` (a cancelled heartbeat loop
    ends once the store calls it was waiting for are cancelled)."""
    try:
        await until(lambda: len(asyncio.all_tasks()) == count, "tasks ended")
    except AssertionError:
        return False
    return True


def lease_renewed(store: SQLiteJobStore, job_id: str) -> bool:
    """Whether the last heartbeat was at the clock's present time."""
    stored = store.get(job_id)
    return stored is not None and stored.lease_until == store.clock.wall() + LEASE_S


async def test_a_job_outliving_its_lease_keeps_it_and_reports_its_phase(
    store: SQLiteJobStore, clock: ManualClock
) -> None:
    jobs = manager(store)
    job = await jobs.record("echo", {"x": 1}, phase="loading", key_id=None)
    first_lease = job.lease_until
    assert first_lease is not None
    work = asyncio.ensure_future(finishes(clock, {"ok": True}, after_s=4 * LEASE_S))
    jobs.follow(job, work, lambda: ("loading", {"bytes": 5, "total_bytes": 10}))

    progress = {"bytes": 5, "total_bytes": 10}
    for _ in range(8):  # 2 2/3 leases, a heartbeat at each step
        await advance(clock, BEAT_S, armed=2)  # the work's timer and the heartbeat's

        def beaten() -> bool:
            stored = store.get(job.id)
            return (
                lease_renewed(store, job.id) and stored is not None and stored.progress == progress
            )

        await until(beaten, "the heartbeat renewed the lease and wrote the phase")
    assert clock.wall() > first_lease + LEASE_S
    stored = store.get(job.id)
    assert stored is not None and stored.status is JobStatus.RUNNING
    assert stored.lease_until is not None and stored.lease_until > clock.wall()
    assert stored.phase == "loading"
    # Nobody else may take a job whose lease is being renewed.
    assert store.claim(job.id, "elsewhere", LEASE_S, 5) is None

    await advance(clock, 4 * LEASE_S, armed=2)  # the work's end
    done = await asyncio.wait_for(jobs.get(job.id, key_id=None, wait_s=5.0), SAFETY_S)
    assert done.status is JobStatus.SUCCEEDED and done.output == {"ok": True}
    assert not jobs.local


async def test_a_burst_of_jobs_shares_one_heartbeat_loop(
    store: SQLiteJobStore, clock: ManualClock
) -> None:
    jobs = manager(store)
    before = len(asyncio.all_tasks())
    works = []
    for i in range(50):
        job = await jobs.record("echo", {"i": i}, phase="loading", key_id=None)
        work = asyncio.ensure_future(finishes(clock, i, after_s=2 * BEAT_S))
        jobs.follow(job, work, lambda: ("loading", None))
        works.append((job, work))
    # The 50 works themselves, and one heartbeat loop: no task per job.
    assert len(asyncio.all_tasks()) - before == 50 + 1
    await advance(clock, BEAT_S, armed=50 + 1)
    await until(lambda: all(lease_renewed(store, job.id) for job, _ in works), "one beat for all")
    await advance(clock, BEAT_S, armed=50 + 1)
    await asyncio.wait_for(jobs.wait_idle(), SAFETY_S)
    for i, (job, _) in enumerate(works):
        stored = store.get(job.id)
        assert stored is not None and stored.status is JobStatus.SUCCEEDED and stored.output == i
    assert await tasks_back_to(before), "the heartbeat loop outlived the last job"


async def test_outcomes_of_failing_work_are_recorded(store: SQLiteJobStore) -> None:
    jobs = manager(store)

    async def raises(exc: Exception) -> None:
        raise exc

    plain = await jobs.record("echo", {}, phase="running", key_id=None)
    jobs.follow(plain, asyncio.ensure_future(raises(ValueError("bad input"))), lambda: ("", None))
    ours = await jobs.record("echo", {}, phase="running", key_id=None)
    jobs.follow(ours, asyncio.ensure_future(raises(LoadFailed("bundle broke"))), lambda: ("", None))
    await asyncio.wait_for(jobs.wait_idle(), SAFETY_S)

    failed = store.get(plain.id)
    assert failed is not None and failed.status is JobStatus.FAILED
    assert failed.error == {"type": "handler-error", "message": "ValueError: bad input"}
    refused = store.get(ours.id)
    assert refused is not None and refused.status is JobStatus.FAILED
    assert refused.error == {"type": "load-failed", "message": "bundle broke"}


async def test_a_job_cancelled_in_the_store_stops_at_the_next_heartbeat(
    store: SQLiteJobStore, clock: ManualClock
) -> None:
    jobs = manager(store)
    job = await jobs.record("echo", {}, phase="running", key_id=None)
    work = asyncio.ensure_future(finishes(clock, "too late", after_s=10 * LEASE_S))
    jobs.follow(job, work, lambda: ("running", None))

    # Another instance sharing the store cancels it (the store alone knows).
    assert store.cancel(job.id) is not None
    await asyncio.sleep(0)
    assert not work.done(), "stopped before a heartbeat could know"
    await advance(clock, BEAT_S, armed=2)
    await asyncio.wait_for(jobs.wait_idle(), SAFETY_S)
    assert work.cancelled()
    stored = store.get(job.id)
    assert stored is not None and stored.status is JobStatus.CANCELLED and stored.output is None


class FlakyHeartbeats(SQLiteJobStore):
    """A real store whose first heartbeat fails, as a store that is briefly down does."""

    failed = False

    def heartbeat(
        self, job_id: str, owner: str, lease_s: float, *, attempt: int | None = None
    ) -> bool:
        if not self.failed:
            self.failed = True
            raise sqlite3.OperationalError("database is locked")
        return super().heartbeat(job_id, owner, lease_s, attempt=attempt)


async def test_a_failed_heartbeat_does_not_stop_the_job(tmp_path: Path, clock: ManualClock) -> None:
    store = FlakyHeartbeats(tmp_path / "jobs.sqlite3", ttl_s=60.0, clock=clock)
    jobs = manager(store)
    job = await jobs.record("echo", {}, phase="running", key_id=None)
    work = asyncio.ensure_future(finishes(clock, 7, after_s=3 * BEAT_S))
    jobs.follow(job, work, lambda: ("", None))
    await advance(clock, BEAT_S, armed=2)
    await until(lambda: store.failed, "the first heartbeat failed")
    await advance(clock, BEAT_S, armed=2)
    await until(lambda: lease_renewed(store, job.id), "the next heartbeat renewed the lease")
    assert not work.done()
    await advance(clock, BEAT_S, armed=2)
    done = await asyncio.wait_for(jobs.get(job.id, key_id=None, wait_s=5.0), SAFETY_S)
    assert done.status is JobStatus.SUCCEEDED and done.output == 7


async def test_abort_all_records_running_jobs_as_drained(
    store: SQLiteJobStore, clock: ManualClock
) -> None:
    jobs = manager(store)
    before = len(asyncio.all_tasks())
    recorded = []
    for _ in range(3):
        job = await jobs.record("echo", {}, phase="running", key_id=None)
        work = asyncio.ensure_future(finishes(clock, None, after_s=10 * LEASE_S))
        jobs.follow(job, work, lambda: ("", None))
        recorded.append(job)
    await asyncio.wait_for(jobs.abort_all(), SAFETY_S)
    for job in recorded:
        stored = store.get(job.id)
        assert stored is not None and stored.status is JobStatus.FAILED
        assert stored.error is not None and stored.error["type"] == "drained"
    assert await tasks_back_to(before)


class CountedReads(SQLiteJobStore):
    """A real store that counts its reads."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reads = 0

    def get(self, job_id: str) -> Job | None:
        self.reads += 1
        return super().get(job_id)


async def test_a_long_poll_of_a_job_held_here_waits_for_its_end_then_answers_from_memory(
    tmp_path: Path, clock: ManualClock
) -> None:
    store = CountedReads(tmp_path / "jobs.sqlite3", ttl_s=60.0, clock=clock)
    jobs = manager(store)
    job = await jobs.record("echo", {}, phase="running", key_id=None)
    release = asyncio.Event()

    async def work() -> str:
        await release.wait()
        return "done"

    jobs.follow(job, asyncio.ensure_future(work()), lambda: ("running", None))
    poll = asyncio.ensure_future(jobs.get(job.id, key_id=None, wait_s=5.0))
    for _ in range(20):  # turns of the loop: the poll reaches its wait
        await asyncio.sleep(0)
    assert not poll.done()  # the job has not ended: nothing can answer the poll yet
    release.set()
    # No clock advance: the poll wakes on the job's end, not on a timer.
    done = await asyncio.wait_for(poll, SAFETY_S)
    assert done.status is JobStatus.SUCCEEDED and done.output == "done"
    # No read by the poll, nor by the outcome's write, which got the record it stored
    # back from the UPDATE itself (RETURNING; older SQLite reads it after the write).
    assert store.reads == (0 if store.returning else 1)
    # Another key's poll of it is answered as for an unknown id, whatever is held here.
    with pytest.raises(UnknownJob):
        await jobs.get(job.id, key_id="someone-else", wait_s=5.0)
