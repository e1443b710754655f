"""A streaming job's items in PostgreSQL (schema version 2): written by the run that
holds the job, in batches, each with its notification, read back in order from
any index, and gone with the job's row. Straight to the server and through
PgBouncer in transaction mode (the writes; the listening session stays direct)."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

import orjson
import psycopg
import pytest

from runtime.clock import ManualClock
from runtime.jobs.job import Job, JobStatus, new_job_id
from runtime.jobs.stores.postgres import PostgresJobStore
from runtime.jobs.stores.postgres_listen import JobEvent
from tests.jobs.postgres_fixtures import PostgresCluster, store_dsn

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)


@pytest.fixture
def stores() -> Iterator[list[PostgresJobStore]]:
    opened: list[PostgresJobStore] = []
    yield opened
    for store in opened:
        store.close()


def running(store: PostgresJobStore, owner: str = "a") -> Job:
    job = Job(id=new_job_id(), handler="ticks", input={})
    store.create(job)
    claimed = store.claim(job.id, owner, 30.0, 3)
    assert claimed is not None
    return claimed


def encoded(*items: Any) -> list[bytes]:
    return [orjson.dumps(item) for item in items]


@pytest.mark.parametrize("through", ["postgres", "pgbouncer"])
def test_items_are_read_in_order_from_any_index_and_each_batch_notifies(
    request: pytest.FixtureRequest, through: str, stores: list[PostgresJobStore]
) -> None:
    url = store_dsn(request, through == "pgbouncer")
    owner, follower = PostgresJobStore(url, ttl_s=3600), PostgresJobStore(url, ttl_s=3600)
    stores += [owner, follower]
    events: queue.Queue[JobEvent] = queue.Queue()
    assert follower.listen(events.put).listening.wait(30)
    job = running(owner)
    assert owner.append_items(job.id, "a", job.attempts, 0, encoded({"t": 0}, {"t": 1}))
    assert owner.append_items(job.id, "a", job.attempts, 2, encoded({"t": 2}))
    # A batch written again (its answer was lost) adds nothing.
    assert owner.append_items(job.id, "a", job.attempts, 2, encoded({"t": 2}))
    assert follower.items_after(job.id, 0) == [{"t": 0}, {"t": 1}, {"t": 2}]
    assert follower.items_after(job.id, 2) == [{"t": 2}]
    assert follower.items_after(job.id, 3) == []
    assert follower.items_after(job.id, 0, limit=2) == [{"t": 0}, {"t": 1}]
    seen = [events.get(timeout=30) for _ in range(5)]
    assert seen[2:] == [JobEvent(job.id, "items", "ticks")] * 3  # after queued, running


def test_a_read_stops_at_the_first_index_not_written(
    stores: list[PostgresJobStore], request: pytest.FixtureRequest
) -> None:
    store = PostgresJobStore(store_dsn(request, False), ttl_s=3600)
    stores.append(store)
    job = running(store)
    assert store.append_items(job.id, "a", 1, 0, encoded("a"))
    assert store.append_items(job.id, "a", 1, 2, encoded("c"))  # index 1 not yet written
    assert store.items_after(job.id, 0) == ["a"]
    assert store.append_items(job.id, "a", 1, 1, encoded("b"))
    assert store.items_after(job.id, 0) == ["a", "b", "c"]


def test_only_the_run_holding_the_job_writes_and_followers_read_the_current_run(
    stores: list[PostgresJobStore], request: pytest.FixtureRequest
) -> None:
    clock = ManualClock()
    store = PostgresJobStore(store_dsn(request, False), ttl_s=3600, clock=clock)
    stores.append(store)
    first = running(store)
    assert store.append_items(first.id, "a", 1, 0, encoded("first-0", "first-1"))
    assert not store.append_items(first.id, "b", 1, 2, encoded("not the owner"))
    clock.advance(31.0)  # the lease lapsed: the same owner claims it again
    second = store.claim(first.id, "a", 30.0, 3)
    assert second is not None and second.attempts == 2
    assert not store.append_items(first.id, "a", 1, 2, encoded("late, of run 1"))
    assert store.items_after(first.id, 0) == []  # run 2 starts its items again
    assert store.append_items(first.id, "a", 2, 0, encoded("second-0"))
    assert store.items_after(first.id, 0) == ["second-0"]
    assert store.finish(first.id, "a", JobStatus.SUCCEEDED, {"n": 1}, attempt=2)
    assert not store.append_items(first.id, "a", 2, 1, encoded("after the end"))
    assert store.items_after(first.id, 0) == ["second-0"]


def test_the_items_go_with_the_jobs_row(
    stores: list[PostgresJobStore],
    request: pytest.FixtureRequest,
    postgres_cluster: PostgresCluster,
    postgres_database: str,
) -> None:
    clock = ManualClock()
    store = PostgresJobStore(store_dsn(request, False), ttl_s=10.0, clock=clock)
    stores.append(store)
    gone, kept = running(store), running(store)
    assert store.append_items(gone.id, "a", 1, 0, encoded(*range(5)))
    assert store.finish(gone.id, "a", JobStatus.SUCCEEDED, {"n": 5}, attempt=1)
    assert store.append_items(kept.id, "a", 1, 0, encoded("k"))
    clock.advance(11.0)  # `gone` expired; `kept`, running, is heartbeated on
    assert store.heartbeat(kept.id, "a", 30.0, attempt=1)
    assert store.items_after(gone.id, 0) == []  # absent at once, as its job is
    assert store.purge_expired() == 1
    with psycopg.connect(postgres_cluster.dsn(postgres_database)) as conn:
        rows = conn.execute("SELECT job_id, count(*) FROM thaw_job_items GROUP BY job_id")
        assert rows.fetchall() == [(kept.id, 1)]


def test_a_version_1_database_gains_the_items_table_at_open(
    stores: list[PostgresJobStore],
    request: pytest.FixtureRequest,
    postgres_cluster: PostgresCluster,
    postgres_database: str,
) -> None:
    url = store_dsn(request, False)
    before = PostgresJobStore(url, ttl_s=3600)
    stores.append(before)
    job = running(before)
    with psycopg.connect(postgres_cluster.dsn(postgres_database), autocommit=True) as conn:
        # What a database written by a Thaw of schema version 1 holds.
        conn.execute("DROP TABLE thaw_job_items")
        conn.execute("UPDATE thaw_schema SET version = 1")
    after = PostgresJobStore(url, ttl_s=3600)
    stores.append(after)
    assert after.get(job.id) == job  # the jobs stayed
    assert after.append_items(job.id, "a", 1, 0, encoded("x"))
    assert after.items_after(job.id, 0) == ["x"]
    with psycopg.connect(postgres_cluster.dsn(postgres_database)) as conn:
        assert conn.execute("SELECT version FROM thaw_schema").fetchall() == [(2,)]
