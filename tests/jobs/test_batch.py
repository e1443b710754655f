"""Group commit of job creation over a real SQLite store."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from runtime.errors import Conflict
from runtime.jobs.batch import CreateBatcher
from runtime.jobs.job import Job, new_job_id
from runtime.jobs.stores.sqlite import SQLiteJobStore

pytestmark = pytest.mark.anyio


class Counting:
    """The store's create_many, counting the writes (batches) it is asked for."""

    def __init__(self, store: SQLiteJobStore) -> None:
        self.store = store
        self.batches: list[int] = []

    def __call__(self, jobs: Sequence[Job]) -> list[Conflict | None]:
        self.batches.append(len(jobs))
        return self.store.create_many(jobs)


def new_job(i: int) -> Job:
    return Job(id=new_job_id(), handler="echo", input={"i": i})


async def test_a_burst_is_stored_in_a_few_writes(store: SQLiteJobStore) -> None:
    writes = Counting(store)
    batcher = CreateBatcher(writes)
    jobs = [new_job(i) for i in range(64)]
    await asyncio.gather(*(batcher.create(job) for job in jobs))
    assert sum(writes.batches) == 64
    assert len(writes.batches) <= 2, writes.batches
    assert all(store.get(job.id) is not None for job in jobs)


async def test_a_lone_creation_is_written_at_once(store: SQLiteJobStore) -> None:
    writes = Counting(store)
    batcher = CreateBatcher(writes)
    job = new_job(0)
    await asyncio.wait_for(batcher.create(job), timeout=5.0)
    assert writes.batches == [1] and store.get(job.id) is not None


async def test_a_used_id_fails_only_its_own_caller(store: SQLiteJobStore) -> None:
    batcher = CreateBatcher(store.create_many)
    used = new_job(0)
    await batcher.create(used)
    results = await asyncio.gather(
        batcher.create(new_job(1)),
        batcher.create(Job(id=used.id, handler="other", input={})),
        batcher.create(new_job(2)),
        return_exceptions=True,
    )
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], Conflict)


async def test_a_failing_store_reaches_every_caller_and_the_next_write_runs(
    store: SQLiteJobStore,
) -> None:
    calls = 0

    def flaky(jobs: Sequence[Job]) -> list[Conflict | None]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OSError("disk full")
        return store.create_many(jobs)

    batcher = CreateBatcher(flaky)
    with pytest.raises(OSError, match="disk full"):
        await batcher.create(new_job(0))
    job = new_job(1)
    await batcher.create(job)
    assert store.get(job.id) is not None
