"""Fencing by attempt, in the job manager on a real PostgreSQL: a run that lost its
lease and was claimed again (by another instance, or by this very owner) is refused
its heartbeats and its finish, and the newer run's result stands.

Two ManualClocks: the first run's never moves (so its heartbeats never fire on
their own, as an instance cut off from the database); the claimer's is moved past
the lease, so the first run's lease has lapsed when it claims.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from runtime.clock import ManualClock
from runtime.jobs.job import Job, JobStatus
from runtime.jobs.manager import JobManager
from runtime.jobs.stores.postgres import PostgresJobStore
from runtime.telemetry.metrics import Metrics
from tests.jobs.postgres_fixtures import PostgresCluster
from tests.support import SAFETY_S

LEASE_S = 30.0


@pytest.fixture
def dsn(postgres_cluster: PostgresCluster, postgres_database: str) -> str:
    return postgres_cluster.dsn(postgres_database)


class Runs:
    """The manager's runner: each run's work is a future the test settles."""

    def __init__(self) -> None:
        self.started: list[tuple[Job, asyncio.Future[Any]]] = []

    def run_job(self, job: Job) -> asyncio.Future[Any]:
        work: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.started.append((job, work))
        return work

    def can_run(self, handler: str) -> bool:
        return True

    def items_of(self, job_id: str) -> None:
        return None  # its runs stream no items


@pytest.fixture
def stores(dsn: str) -> Iterator[list[PostgresJobStore]]:
    made: list[PostgresJobStore] = []
    yield made
    for store in made:
        store.close()


def manager(
    stores: list[PostgresJobStore], dsn: str, owner: str, clock: ManualClock, runner: Runs
) -> JobManager:
    store = PostgresJobStore(dsn, ttl_s=3600, clock=clock)
    stores.append(store)
    return JobManager(
        store,
        owner=owner,
        lease_s=LEASE_S,
        max_attempts=3,
        metrics=Metrics(),
        clock=clock,
        runner=runner,
    )


async def settled(manager: JobManager, job_id: str) -> None:
    """Until `job_id` is no longer held by `manager` (its outcome recorded or discarded)."""
    async with asyncio.timeout(SAFETY_S):
        while job_id in manager.local:
            await asyncio.sleep(0.01)


@pytest.mark.anyio
@pytest.mark.parametrize("claimer", ["another-instance", "the-same-owner"])
async def test_a_reclaimed_run_is_refused_its_finish_and_the_newer_result_stands(
    dsn: str, stores: list[PostgresJobStore], claimer: str
) -> None:
    first_clock, later_clock = ManualClock(), ManualClock()
    first = manager(stores, dsn, "instance-a", first_clock, Runs())
    owner = "instance-a" if claimer == "the-same-owner" else "instance-b"
    reruns = Runs()
    later = manager(stores, dsn, owner, later_clock, reruns)
    try:
        job = await first.record("echo", {"n": 1}, phase="running", key_id=None)
        old_work: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        first.follow(job, old_work, lambda: ("running", None))
        later_clock.advance(LEASE_S + 1)  # the first run's lease has lapsed, for the claimer
        assert await later.sweep() == 1
        [(rerun, new_work)] = reruns.started
        assert rerun.attempts == 2 and rerun.owner == owner

        # The first run ends while the newer one runs: its finish is refused (with
        # the same owner, only the attempt tells the two runs apart).
        old_work.set_result({"from": "the first run"})
        await settled(first, job.id)
        stored = await asyncio.to_thread(later.store.get, job.id)
        assert stored is not None
        assert (stored.status, stored.attempts, stored.output) == (JobStatus.RUNNING, 2, None)

        # Its heartbeat is refused too: its clock moves now, the beat fires.
        assert not await asyncio.to_thread(
            first.store.heartbeat, job.id, "instance-a", LEASE_S, attempt=1
        )

        new_work.set_result({"from": "the newer run"})
        await settled(later, job.id)
        done = await later.get(job.id, key_id=None)
        assert (done.status, done.attempts, done.output) == (
            JobStatus.SUCCEEDED,
            2,
            {"from": "the newer run"},
        )
    finally:
        first.close()
        later.close()


@pytest.mark.anyio
@pytest.mark.parametrize("claimer", ["another-instance", "the-same-owner"])
async def test_a_reclaimed_runs_next_heartbeat_stops_its_work(
    dsn: str, stores: list[PostgresJobStore], claimer: str
) -> None:
    first_clock, later_clock = ManualClock(), ManualClock()
    first = manager(stores, dsn, "instance-a", first_clock, Runs())
    reruns = Runs()
    owner = "instance-a" if claimer == "the-same-owner" else "instance-b"
    later = manager(stores, dsn, owner, later_clock, reruns)
    try:
        job = await first.record("echo", {"n": 1}, phase="running", key_id=None)
        old_work: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        first.follow(job, old_work, lambda: ("running", None))
        later_clock.advance(LEASE_S + 1)
        assert await later.sweep() == 1
        first_clock.advance(LEASE_S / 3)  # the first run's heartbeat is due
        await settled(first, job.id)
        # Refused, it read the job: running, but a newer run's. Its work is stopped.
        assert old_work.cancelled()
        [(_, new_work)] = reruns.started
        new_work.set_result({"from": "the newer run"})
        await settled(later, job.id)
        done = await later.get(job.id, key_id=None)
        assert (done.status, done.attempts, done.output) == (
            JobStatus.SUCCEEDED,
            2,
            {"from": "the newer run"},
        )
    finally:
        first.close()
        later.close()
