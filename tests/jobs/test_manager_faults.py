"""The job manager when its store fails for real: a full disk (a small tmpfs), a
database deleted under it, and an instance of this node that died.

Outcomes are never lost nor computed twice, readiness follows the store (one log
line when it fails, one when it is back), and a dead owner's jobs are taken at once.

The manager and its store share a `ManualClock`: leases lapse, and heartbeats,
retries and the store probe come due, as a test moves it; the faults are real.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime.clock import ManualClock
from runtime.errors import StorageUnavailable
from runtime.jobs.job import Job, JobStatus, new_job_id
from runtime.jobs.manager import STORE_CONDITION, JobManager
from runtime.jobs.owners import OwnerLock
from runtime.jobs.stores.sqlite import SQLiteJobStore
from runtime.telemetry.health import Health
from runtime.telemetry.logs import DEFERRED_LOGS
from runtime.telemetry.metrics import Metrics
from tests.jobs import tmpfs

pytestmark = pytest.mark.anyio

LEASE_S = 30.0  # heartbeats every 10 s, a sweep would take a job 30 s after its last one
# How far a test moves the clock between looks at what it waits for: past the
# longest back-off of outcome writes and probes (RETRY_MAX_S).
STEP_S = 2.0
# A safety limit on waiting for real threads (store calls), never a bound under test.
SAFETY_S = 30.0


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with tmpfs.mounted(tmp_path / "disk", "2m") as disk:
        yield disk


class Rerun:
    """The job manager's runner (the dispatcher's part): each job's work, from `work(job)`."""

    def __init__(self, work: Callable[[Job], Awaitable[Any]]) -> None:
        self.work = work

    def run_job(self, job: Job) -> asyncio.Future[Any]:
        return asyncio.ensure_future(self.work(job))

    def can_run(self, handler: str) -> bool:
        return True

    def items_of(self, job_id: str) -> None:
        return None  # its runs stream no items


def manager(
    store: SQLiteJobStore,
    health: Health,
    owner: str = "here",
    owners: Path | None = None,
    runner: Rerun | None = None,
) -> JobManager:
    return JobManager(
        store,
        owner=owner,
        lease_s=LEASE_S,
        max_attempts=3,
        metrics=Metrics(),
        health=health,
        owners_dir=owners,
        runner=runner,
        clock=store.clock,
    )


async def until(condition: Any, what: str, clock: ManualClock | None = None) -> None:
    """Wait for `condition()` while real threads (store calls) work towards it; with
    `clock`, moving it on by STEP_S between looks, so the timers due by then fire
    (heartbeats, retried writes, the probe). The number of looks is a safety limit,
    not a bound under test."""
    for _ in range(4000):
        if condition():
            return
        if clock is not None:
            clock.advance(STEP_S)
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


async def test_an_outcome_refused_by_a_full_disk_is_kept_and_recorded_once_freed(
    small_disk: Path, caplog: pytest.LogCaptureFixture, clock: ManualClock
) -> None:
    store = SQLiteJobStore(small_disk / "jobs.sqlite3", ttl_s=600.0, clock=clock)
    health = Health()
    runs: list[int] = []
    release = asyncio.Event()

    async def work() -> dict[str, int]:
        runs.append(len(runs) + 1)
        await release.wait()
        return {"run": runs[-1]}

    jobs = manager(store, health, runner=Rerun(lambda job: work()))  # a re-run would count
    job = await jobs.record("echo", {}, phase="running", key_id=None)
    jobs.follow(job, asyncio.ensure_future(work()), lambda: ("running", None))

    with caplog.at_level(logging.INFO):
        filler = tmpfs.fill(small_disk)
        release.set()  # the work ends while the store cannot write its outcome
        await until(lambda: STORE_CONDITION in health.conditions, "readiness off")
        stored = store.get(job.id)
        assert stored is not None and stored.lease_until is not None
        lease_until = stored.lease_until
        await until(lambda: clock.wall() > lease_until + LEASE_S, "the lease lapsed", clock)
        # Lapsed in the store, but held here: the sweep leaves it alone.
        assert job.id in store.lapsed()
        assert await jobs.sweep() == 0
        with pytest.raises(StorageUnavailable):
            await jobs.record("echo", {}, phase="running", key_id=None)
        assert not health.ok

        tmpfs.free(filler)
        await until(lambda: not jobs.local, "the outcome recorded", clock)
        await asyncio.wait_for(jobs.wait_idle(), SAFETY_S)
        DEFERRED_LOGS.flush()  # the outcome's line is kept for the access lines' window (logs.py)

    final = store.get(job.id)
    assert final is not None and final.status is JobStatus.SUCCEEDED
    assert final.output == {"run": 1} and final.attempts == 1
    assert runs == [1], "the finished work ran again"
    assert health.ok
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if m.startswith(f"unready: {STORE_CONDITION}")]) == 1
    assert len([m for m in messages if m.startswith(f"ready again: {STORE_CONDITION}")]) == 1
    assert any(job.id in m and "recorded at try" in m for m in messages)
    jobs.close()
    store.close()


async def test_readiness_comes_back_with_no_traffic(small_disk: Path, clock: ManualClock) -> None:
    store = SQLiteJobStore(small_disk / "jobs.sqlite3", ttl_s=600.0, clock=clock)
    health = Health()
    jobs = manager(store, health)
    filler = tmpfs.fill(small_disk)
    with pytest.raises(StorageUnavailable) as caught:
        await jobs.record("echo", {}, phase="running", key_id=None)
    assert caught.value.retry_after_s is not None
    assert not health.ok
    tmpfs.free(filler)
    await until(lambda: health.ok, "the probe found the store writable", clock)
    job = await jobs.record("echo", {}, phase="running", key_id=None)
    assert store.get(job.id) is not None
    jobs.close()
    store.close()


async def test_a_drain_gives_up_outcomes_the_store_never_takes_and_keeps_the_lock_file(
    small_disk: Path, tmp_path: Path, clock: ManualClock
) -> None:
    store = SQLiteJobStore(small_disk / "jobs.sqlite3", ttl_s=600.0, clock=clock)
    owners = tmp_path / "owners"
    jobs = manager(store, Health(), owners=owners)
    jobs.hold_owner_lock()
    job = await jobs.record("echo", {}, phase="running", key_id=None)
    jobs.follow(job, asyncio.ensure_future(clock.sleep(600.0)), lambda: ("running", None))
    filler = tmpfs.fill(small_disk)
    began = clock.monotonic()
    aborting = asyncio.ensure_future(jobs.abort_all())
    await asyncio.sleep(0)
    assert not aborting.done(), "gave up before the grace"
    await until(aborting.done, "the drain gave up on the outcome", clock)
    assert clock.monotonic() - began >= jobs.final_write_grace_s
    await asyncio.wait_for(aborting, SAFETY_S)
    tmpfs.free(filler)
    stored = store.get(job.id)
    assert stored is not None and stored.status is JobStatus.RUNNING and stored.owner == "here"
    jobs.close()
    # The next instance of this node finds this owner dead and takes the job at once.
    assert [p.name for p in owners.iterdir()] == ["here.lock"]
    store.close()


async def test_a_record_gone_with_a_deleted_database_is_written_again(
    tmp_path: Path, clock: ManualClock
) -> None:
    path = tmp_path / "jobs.sqlite3"
    store = SQLiteJobStore(path, ttl_s=600.0, clock=clock)
    jobs = manager(store, Health())
    release = asyncio.Event()

    async def work() -> str:
        await release.wait()
        return "done"

    job = await jobs.record("echo", {"x": 1}, phase="running", key_id="k")
    jobs.follow(job, asyncio.ensure_future(work()), lambda: ("running", None))
    os.unlink(path)
    # The next heartbeat finds it gone from the (new) file and writes it again.
    await until(lambda: store.get(job.id) is not None, "the record written again", clock)
    release.set()
    done = await asyncio.wait_for(jobs.get(job.id, key_id="k", wait_s=20), SAFETY_S)
    assert done.status is JobStatus.SUCCEEDED and done.output == "done"
    fresh = SQLiteJobStore(path, ttl_s=600.0, clock=clock)
    got = fresh.get(job.id)
    assert got is not None and got.output == "done" and got.input == {"x": 1}
    fresh.close()
    jobs.close()
    store.close()


def running_job(store: SQLiteJobStore, owner: str, lease_s: float = 600.0) -> Job:
    job = Job(
        id=new_job_id(),
        handler="echo",
        input={"n": 1},
        status=JobStatus.RUNNING,
        attempts=1,
        owner=owner,
        lease_until=store.clock.wall() + lease_s,
    )
    store.create(job)
    return job


async def test_the_jobs_of_a_dead_owner_of_this_node_are_taken_at_once(
    tmp_path: Path, clock: ManualClock
) -> None:
    store = SQLiteJobStore(tmp_path / "jobs.sqlite3", ttl_s=600.0, clock=clock)
    owners = tmp_path / "owners"
    dead = OwnerLock(owners, "dead")
    assert dead.hold()
    orphan = running_job(store, "dead")
    finished = running_job(store, "dead")
    assert store.finish(finished.id, "dead", JobStatus.SUCCEEDED, {"kept": True})
    dead.release(delete=False)  # the process died: lock dropped, file left behind
    living = OwnerLock(owners, "living")
    assert living.hold()
    theirs = running_job(store, "living")
    elsewhere = running_job(store, "other-node")  # no lock file here: its lease decides

    ran: list[str] = []

    async def rerun(job: Job) -> str:
        ran.append(job.id)
        return "again"

    jobs = manager(store, Health(), owner="heir", owners=owners, runner=Rerun(rerun))
    jobs.hold_owner_lock()
    assert await jobs.reclaim_dead_owners() == 1
    await asyncio.wait_for(jobs.wait_idle(), SAFETY_S)

    assert ran == [orphan.id]
    got = store.get(orphan.id)
    assert got is not None and got.status is JobStatus.SUCCEEDED and got.output == "again"
    assert got.attempts == 2 and got.owner == "heir"
    kept = store.get(finished.id)
    assert kept is not None and kept.output == {"kept": True} and kept.attempts == 1
    for untouched, owner in ((theirs, "living"), (elsewhere, "other-node")):
        now = store.get(untouched.id)
        assert now is not None and now.owner == owner and now.status is JobStatus.RUNNING
    assert sorted(p.name for p in owners.iterdir()) == ["heir.lock", "living.lock"]
    assert await jobs.reclaim_dead_owners() == 0
    living.release()
    jobs.close()
    store.close()
