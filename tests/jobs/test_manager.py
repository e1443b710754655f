"""The job manager over a real SQLite store: leases, phases, outcomes, cancellation, drain."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from runtime.errors import LoadFailed
from runtime.jobs.job import JobStatus
from runtime.jobs.manager import JobManager
from runtime.jobs.stores.sqlite import SQLiteJobStore
from runtime.telemetry.metrics import Metrics

pytestmark = pytest.mark.anyio

LEASE_S = 0.3  # heartbeats every 0.1 s


def manager(store: SQLiteJobStore) -> JobManager:
    return JobManager(store, owner="here", lease_s=LEASE_S, max_attempts=2, metrics=Metrics())


async def finishes(value: Any, after_s: float) -> Any:
    await asyncio.sleep(after_s)
    return value


async def tasks_back_to(count: int) -> bool:
    """Whether the running tasks fall back to `count` within a second (a cancelled
    heartbeat loop ends once the store calls it was waiting for are cancelled)."""
    for _ in range(100):
        if len(asyncio.all_tasks()) == count:
            return True
        await asyncio.sleep(0.01)
    return False


async def test_a_job_outliving_its_lease_keeps_it_and_reports_its_phase(
    store: SQLiteJobStore,
) -> None:
    jobs = manager(store)
    job = await jobs.record("echo", {"x": 1}, phase="loading", key_id=None)
    work = asyncio.ensure_future(finishes({"ok": True}, after_s=4 * LEASE_S))
    jobs.follow(job, work, lambda: ("loading", {"bytes": 5, "total_bytes": 10}))

    await asyncio.sleep(2.5 * LEASE_S)
    stored = store.get(job.id)
    assert stored is not None and stored.status is JobStatus.RUNNING
    assert stored.lease_until is not None and stored.lease_until > time.time()
    assert stored.phase == "loading" and stored.progress == {"bytes": 5, "total_bytes": 10}
    # Nobody else may take a job whose lease is being renewed.
    assert store.claim(job.id, "elsewhere", LEASE_S, 5) is None

    done = await jobs.get(job.id, key_id=None, wait_s=5.0)
    assert done.status is JobStatus.SUCCEEDED and done.output == {"ok": True}
    assert not jobs.local


async def test_a_burst_of_jobs_shares_one_heartbeat_loop(store: SQLiteJobStore) -> None:
    jobs = manager(store)
    before = len(asyncio.all_tasks())
    works = []
    for i in range(50):
        job = await jobs.record("echo", {"i": i}, phase="loading", key_id=None)
        work = asyncio.ensure_future(finishes(i, after_s=2 * LEASE_S))
        jobs.follow(job, work, lambda: ("loading", None))
        works.append((job, work))
    # The 50 works themselves, and one heartbeat loop: no task per job.
    assert len(asyncio.all_tasks()) - before == 50 + 1
    await jobs.wait_idle()
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
    await jobs.wait_idle()

    failed = store.get(plain.id)
    assert failed is not None and failed.status is JobStatus.FAILED
    assert failed.error == {"type": "handler-error", "message": "ValueError: bad input"}
    refused = store.get(ours.id)
    assert refused is not None and refused.status is JobStatus.FAILED
    assert refused.error == {"type": "load-failed", "message": "bundle broke"}


async def test_a_job_cancelled_in_the_store_stops_at_the_next_heartbeat(
    store: SQLiteJobStore,
) -> None:
    jobs = manager(store)
    job = await jobs.record("echo", {}, phase="running", key_id=None)
    work = asyncio.ensure_future(finishes("too late", after_s=30.0))
    jobs.follow(job, work, lambda: ("running", None))

    # Another instance sharing the store cancels it (the store alone knows).
    assert store.cancel(job.id) is not None
    await asyncio.wait_for(jobs.wait_idle(), timeout=2.0)
    assert work.cancelled()
    stored = store.get(job.id)
    assert stored is not None and stored.status is JobStatus.CANCELLED and stored.output is None


class FlakyHeartbeats(SQLiteJobStore):
    """A real store whose first heartbeat fails, as a store that is briefly down does."""

    failed = False

    def heartbeat(self, job_id: str, owner: str, lease_s: float) -> bool:
        if not self.failed:
            self.failed = True
            raise sqlite3.OperationalError("database is locked")
        return super().heartbeat(job_id, owner, lease_s)


async def test_a_failed_heartbeat_does_not_stop_the_job(tmp_path: Path) -> None:
    store = FlakyHeartbeats(tmp_path / "jobs.sqlite3", ttl_s=60.0)
    jobs = manager(store)
    job = await jobs.record("echo", {}, phase="running", key_id=None)
    jobs.follow(job, asyncio.ensure_future(finishes(7, after_s=3 * LEASE_S)), lambda: ("", None))
    done = await jobs.get(job.id, key_id=None, wait_s=5.0)
    assert store.failed
    assert done.status is JobStatus.SUCCEEDED and done.output == 7


async def test_abort_all_records_running_jobs_as_drained(store: SQLiteJobStore) -> None:
    jobs = manager(store)
    before = len(asyncio.all_tasks())
    recorded = []
    for _ in range(3):
        job = await jobs.record("echo", {}, phase="running", key_id=None)
        jobs.follow(job, asyncio.ensure_future(finishes(None, after_s=30.0)), lambda: ("", None))
        recorded.append(job)
    await asyncio.wait_for(jobs.abort_all(), timeout=5.0)
    for job in recorded:
        stored = store.get(job.id)
        assert stored is not None and stored.status is JobStatus.FAILED
        assert stored.error is not None and stored.error["type"] == "drained"
    assert await tasks_back_to(before)
