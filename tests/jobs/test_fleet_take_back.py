"""A job this instance recorded queued and its own fleet queue then claims: taken back.

The fleet queue (runtime/jobs/fleet.py `take_queued`) looks whether the instance
is idle, then claims the fleet's oldest queued job in a worker thread. That claim
may commit after the instance recorded a job of its own queued (it waits here for
capacity), and take it. The claim is then that job's, handed to the work that
waits for it (Leases.take_back): the job runs once, here, and its outcome is
recorded. A second run of it here, under the same id, replaced the first run's
hold and left one of the two unrecorded, `running` until its lease lapsed.

The claim lands at each point of the job's life here: once it is held, while its
record is still being written, and while its work's own claim is being written.
On a real PostgreSQL with a ManualClock; each step is ordered by events (a store
call held at a gate in its thread), never by time.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from runtime.clock import ManualClock
from runtime.errors import Conflict
from runtime.jobs.fleet import Fleet
from runtime.jobs.job import Job, JobStatus
from runtime.jobs.manager import JobManager
from runtime.jobs.stores.postgres import PostgresJobStore
from runtime.telemetry.metrics import Metrics
from tests.inproc import until
from tests.jobs.postgres_fixtures import PostgresCluster
from tests.support import SAFETY_S

pytestmark = pytest.mark.anyio

LEASE_S = 600.0
HANDLER = "one_at_a_time"


class GatedStore(PostgresJobStore):
    """The real store; a create or a claim can be held at a gate in its thread (a
    create once it has committed, a claim before its statement), to order the
    fleet queue's claim against it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.created = threading.Event()
        self.create_gate: threading.Event | None = None
        self.claiming = threading.Event()
        self.claim_gate: threading.Event | None = None

    def create_many(self, jobs: Sequence[Job]) -> list[Conflict | None]:
        results = super().create_many(jobs)
        self.created.set()
        if self.create_gate is not None:
            assert self.create_gate.wait(SAFETY_S), "the create gate never opened"
        return results

    def claim(self, job_id: str, owner: str, lease_s: float, max_attempts: int) -> Job | None:
        self.claiming.set()
        if self.claim_gate is not None:
            assert self.claim_gate.wait(SAFETY_S), "the claim gate never opened"
        return super().claim(job_id, owner, lease_s, max_attempts)


class Runs:
    """The manager's runner: what the fleet queue starts here (a second run, if any)."""

    def __init__(self) -> None:
        self.started: list[Job] = []
        self.ran = asyncio.Event()

    def run_job(self, job: Job) -> asyncio.Future[Any]:
        self.started.append(job)
        self.ran.set()
        return asyncio.get_running_loop().create_future()

    def can_run(self, handler: str) -> bool:
        return True

    def items_of(self, job_id: str) -> None:
        return None


class IdleOnce:
    """The instance as its fleet queue sees it: idle at the look its claim follows,
    busy at every later one (its own job is in flight by then)."""

    def __init__(self) -> None:
        self.looks = 0
        self.looked_again = asyncio.Event()

    def idle(self) -> bool:
        self.looks += 1
        if self.looks > 1:
            self.looked_again.set()
        return self.looks == 1

    def draining(self) -> bool:
        return False

    def handlers(self) -> list[str]:
        return [HANDLER]

    def warm(self, handler: str) -> bool:
        return True


class Here:
    """One instance: its manager on a gated store, and its fleet part."""

    def __init__(self, dsn: str) -> None:
        self.clock = ManualClock()
        self.store = GatedStore(dsn, ttl_s=3600, clock=self.clock)
        self.runs = Runs()
        self.jobs = JobManager(
            self.store,
            owner="here",
            lease_s=LEASE_S,
            max_attempts=3,
            metrics=Metrics(),
            clock=self.clock,
            runner=self.runs,
        )
        self.fleet = Fleet(self.jobs)
        assert self.fleet.start(self.store)
        self.looks = IdleOnce()
        self.taking: asyncio.Task[None] | None = None

    async def fleet_claims(self) -> None:
        """The fleet queue looks (idle), claims the oldest queued job and deals with
        its claim: until it looks again, or it started a run of the job here."""
        self.taking = asyncio.ensure_future(self.fleet.take_queued(self.looks))
        waits = [asyncio.ensure_future(e.wait()) for e in (self.looks.looked_again, self.runs.ran)]
        try:
            async with asyncio.timeout(SAFETY_S):
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def close(self) -> None:
        if self.taking is not None:
            self.taking.cancel()
            await asyncio.gather(self.taking, return_exceptions=True)
        self.fleet.close()
        self.jobs.close()
        self.store.close()


@pytest.fixture
def dsn(postgres_cluster: PostgresCluster, postgres_database: str) -> str:
    return postgres_cluster.dsn(postgres_database)


@pytest.fixture
async def here(dsn: str) -> AsyncIterator[Here]:
    made = Here(dsn)
    try:
        yield made
    finally:
        await made.close()


def waiting_work() -> asyncio.Future[Any]:
    return asyncio.get_running_loop().create_future()


def follow(here: Here, job: Job, work: asyncio.Future[Any]) -> None:
    here.jobs.follow(job, work, lambda: ("batching", None))


async def runs_once_here(here: Here, job: Job, work: asyncio.Future[Any]) -> None:
    """No second run started; the waiting work ends and its outcome is the job's."""
    assert here.runs.started == [], "a second run of the job started here"
    work.set_result({"id": "job-1"})
    await until(lambda: job.id not in here.jobs.local, "its outcome recorded (or discarded)")
    done = await asyncio.to_thread(here.store.get, job.id)
    assert done is not None
    assert (done.status, done.owner, done.attempts, done.output) == (
        JobStatus.SUCCEEDED,
        "here",
        1,
        {"id": "job-1"},
    ), done


async def test_a_held_job_the_fleet_queue_claims_runs_once_on_its_waiting_work(here: Here) -> None:
    job = await here.jobs.record(HANDLER, {"id": "job-1"}, phase="queued", key_id=None, queued=True)
    work = waiting_work()
    follow(here, job, work)

    await here.fleet_claims()

    assert here.runs.started == [], "a second run of the job started here"
    assert await here.jobs.claim_queued(job.id), "its work's claim finds the job taken back"
    await runs_once_here(here, job, work)


async def test_a_job_claimed_while_its_record_is_written_is_taken_back_once_followed(
    here: Here,
) -> None:
    here.store.create_gate = gate = threading.Event()
    recording = asyncio.ensure_future(
        here.jobs.record(HANDLER, {"id": "job-1"}, phase="queued", key_id=None, queued=True)
    )
    try:
        assert await asyncio.to_thread(here.store.created.wait, SAFETY_S), "never recorded"
        await here.fleet_claims()  # committed, the record's answer not back yet
        assert here.runs.started == [], "a second run of the job started here"
    finally:
        gate.set()
    job = await recording
    assert job.status is JobStatus.QUEUED, "answered as recorded"
    work = waiting_work()
    follow(here, job, work)

    assert await here.jobs.claim_queued(job.id), "its work's claim finds the job taken back"
    await runs_once_here(here, job, work)


async def test_a_job_taken_back_while_its_work_claims_it_runs_on_that_claim(here: Here) -> None:
    job = await here.jobs.record(HANDLER, {"id": "job-1"}, phase="queued", key_id=None, queued=True)
    work = waiting_work()
    follow(here, job, work)
    here.store.claim_gate = gate = threading.Event()
    claiming = asyncio.ensure_future(here.jobs.claim_queued(job.id))
    try:
        assert await asyncio.to_thread(here.store.claiming.wait, SAFETY_S), "never claimed"
        await here.fleet_claims()  # while the work's own claim waits to be written
        assert here.runs.started == [], "a second run of the job started here"
    finally:
        gate.set()
    assert await claiming, "its work's claim lost to this very instance: it won"
    await runs_once_here(here, job, work)
