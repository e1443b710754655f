"""Group commit of job creation over a real SQLite store."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from runtime.errors import Conflict
from runtime.jobs.group_commit import GroupCommit
from runtime.jobs.job import Job, new_job_id
from runtime.jobs.stores.sqlite import SQLiteJobStore

pytestmark = pytest.mark.anyio


class Counting:
    """The store's create_many, counting the writes (groups) it is asked for."""

    def __init__(self, store: SQLiteJobStore) -> None:
        self.store = store
        self.groups: list[int] = []

    def __call__(self, jobs: Sequence[Job]) -> list[Conflict | None]:
        self.groups.append(len(jobs))
        return self.store.create_many(jobs)


def new_job(i: int) -> Job:
    return Job(id=new_job_id(), handler="echo", input={"i": i})


async def test_a_burst_is_stored_in_a_few_writes(store: SQLiteJobStore) -> None:
    writes = Counting(store)
    commits = GroupCommit(writes)
    jobs = [new_job(i) for i in range(64)]
    await asyncio.gather(*(commits.create(job) for job in jobs))
    assert sum(writes.groups) == 64
    assert len(writes.groups) <= 2, writes.groups
    assert all(store.get(job.id) is not None for job in jobs)


async def test_a_lone_creation_is_written_at_once(store: SQLiteJobStore) -> None:
    writes = Counting(store)
    commits = GroupCommit(writes)
    job = new_job(0)
    await asyncio.wait_for(commits.create(job), timeout=5.0)
    assert writes.groups == [1] and store.get(job.id) is not None


async def test_a_used_id_fails_only_its_own_caller(store: SQLiteJobStore) -> None:
    commits = GroupCommit(store.create_many)
    used = new_job(0)
    await commits.create(used)
    results = await asyncio.gather(
        commits.create(new_job(1)),
        commits.create(Job(id=used.id, handler="other", input={})),
        commits.create(new_job(2)),
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

    commits = GroupCommit(flaky)
    with pytest.raises(OSError, match="disk full"):
        await commits.create(new_job(0))
    job = new_job(1)
    await commits.create(job)
    assert store.get(job.id) is not None
