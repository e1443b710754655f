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
from tests.support import SAFETY_S

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


def final_job(name: str, clock: ManualClock, payload_bytes: int) -> Job:
    return Job(
        id=name,
        handler="echo",
        input={},
        status=JobStatus.SUCCEEDED,
        expires_at=clock.wall() + 1000.0,
        payload_bytes=payload_bytes,
    )


def test_the_memory_is_bounded_in_payload_bytes_as_well_as_in_records() -> None:
    clock = ManualClock()
    # 100 records at most, so each costs 1,000 bytes before its payloads.
    finished = FinishedJobs(max_jobs=100, clock=clock, max_bytes=100_000)
    for i in range(30):
        finished.remember(final_job(f"large-{i}", clock, 6_000))
    # 7,000 bytes a record: 14 fit, the least recently used went first.
    assert len(finished) == 14 and finished.size_bytes == 98_000
    assert finished.get("large-15") is None and finished.get("large-16") is not None

    # Past a sixteenth of the bound a record is not kept, and pushes nothing out.
    finished.remember(final_job("huge", clock, 6_251))
    assert finished.get("huge") is None and len(finished) == 14

    for i in range(300):
        finished.remember(final_job(f"small-{i}", clock, 0))
    assert len(finished) == 100 and finished.get("small-299") is not None


async def test_a_job_too_large_to_remember_is_answered_from_the_store(tmp_path: Path) -> None:
    store = CountedStore(tmp_path / "jobs.sqlite3")
    jobs = manager(store)
    output = {"text": "x" * (1024 * 1024 + 1)}  # past a sixteenth of the 16 MiB bound
    job = await jobs.record("echo", {}, phase="running", key_id=None)
    jobs.follow(job, asyncio.ensure_future(asyncio.sleep(0, output)), lambda: ("running", None))
    await jobs.wait_idle()
    store.reads = 0
    for _ in range(2):
        polled = await jobs.get(job.id, key_id=None)
        assert polled.status is JobStatus.SUCCEEDED and polled.output == output
    assert store.reads == 2
    assert len(jobs.finished) == 0


async def test_a_job_output_is_recorded_as_its_answer_encodes_it(tmp_path: Path) -> None:
    """numpy values (which an answer encodes) in a job's output: recorded as JSON."""
    numpy = pytest.importorskip("numpy")
    store = CountedStore(tmp_path / "jobs.sqlite3")
    jobs = manager(store)
    output = {"scores": numpy.arange(3, dtype=numpy.float32) / 2}
    job = await jobs.record("echo", {}, phase="running", key_id=None)
    jobs.follow(job, asyncio.ensure_future(asyncio.sleep(0, output)), lambda: ("running", None))
    # Until now the store's own serializer refused such an output: never recorded.
    await asyncio.wait_for(jobs.wait_idle(), SAFETY_S)
    stored = store.inner.get(job.id)
    assert stored is not None and stored.status is JobStatus.SUCCEEDED
    assert stored.output == {"scores": [0.0, 0.5, 1.0]}
