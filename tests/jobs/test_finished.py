"""Finished jobs answered from memory: a poll of a final job does not read the store,
a running job is always read afresh, another key's job stays unknown, and a record
is forgotten when it expires, as the store forgets it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from runtime.clock import ManualClock
from runtime.errors import UnknownJob
from runtime.jobs.finished import FinishedJobs
from runtime.jobs.job import Job, JobStatus
from runtime.jobs.manager import JobManager
from runtime.jobs.stores.sqlite import SQLiteJobStore
from runtime.telemetry.metrics import Metrics

pytestmark = pytest.mark.anyio


class CountedStore:
    """A real SQLite store that counts the reads it serves."""

    def __init__(self, path: Path) -> None:
        self.inner = SQLiteJobStore(path, ttl_s=60.0)
        self.reads = 0

    def get(self, job_id: str) -> Job | None:
        self.reads += 1
        return self.inner.get(job_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def manager(store: Any) -> JobManager:
    return JobManager(store, owner="here", lease_s=0.3, max_attempts=2, metrics=Metrics())


async def test_polls_of_a_job_finished_here_read_what_its_write_stored(tmp_path: Path) -> None:
    store = CountedStore(tmp_path / "jobs.sqlite3")
    jobs = manager(store)
    job = await jobs.record("echo", {"x": 1}, phase="running", key_id="k1")
    release = asyncio.Event()

    async def work() -> dict[str, int]:
        await release.wait()
        return {"x": 1}

    jobs.follow(job, asyncio.ensure_future(work()), lambda: ("running", None))
    running = [await jobs.get(job.id, key_id="k1") for _ in range(3)]
    assert [j.status for j in running] == [JobStatus.RUNNING] * 3
    assert store.reads == 3  # a running job changes: every poll reads it

    release.set()
    await jobs.wait_idle()
    store.reads = 0
    polls = [await jobs.get(job.id, key_id="k1") for _ in range(5)]
    assert all(p.status is JobStatus.SUCCEEDED and p.output == {"x": 1} for p in polls)
    # Its outcome's write read the final record back: no poll reads the store.
    assert store.reads == 0
    assert (await jobs.cancel(job.id, key_id="k1")).status is JobStatus.SUCCEEDED
    assert store.reads == 0

    with pytest.raises(UnknownJob):
        await jobs.get(job.id, key_id="another key")


async def test_a_finished_job_stays_readable_while_the_store_is_gone(tmp_path: Path) -> None:
    store = CountedStore(tmp_path / "jobs.sqlite3")
    jobs = manager(store)
    job = await jobs.record("echo", {}, phase="running", key_id=None)
    jobs.follow(job, asyncio.ensure_future(asyncio.sleep(0, "done")), lambda: ("running", None))
    await jobs.wait_idle()
    assert (await jobs.get(job.id, key_id=None)).output == "done"

    # The database is deleted and replaced: the store knows nothing of the job now.
    store.inner = SQLiteJobStore(tmp_path / "other.sqlite3", ttl_s=60.0)
    assert store.inner.get(job.id) is None
    assert (await jobs.get(job.id, key_id=None)).output == "done"


def test_a_record_is_forgotten_at_its_expiry_and_only_final_ones_are_kept() -> None:
    clock = ManualClock()
    expires_at = clock.wall() + 60.0
    finished = FinishedJobs(max_jobs=2, clock=clock)
    done = Job(id="a", handler="echo", input={}, status=JobStatus.SUCCEEDED, expires_at=expires_at)
    running = Job(id="b", handler="echo", input={}, status=JobStatus.RUNNING, expires_at=expires_at)
    finished.remember(done)
    finished.remember(running)
    assert finished.get("a") is done
    assert finished.get("b") is None

    clock.advance(59.0)
    assert finished.get("a") is done
    clock.advance(1.0)
    assert finished.get("a") is None

    # Bounded: the least recently used goes first.
    for name in ("c", "d", "e"):
        finished.remember(
            Job(
                id=name,
                handler="echo",
                input={},
                status=JobStatus.FAILED,
                expires_at=clock.wall() + 1000.0,
            )
        )
    assert len(finished) == 2
    assert finished.get("c") is None and finished.get("e") is not None
