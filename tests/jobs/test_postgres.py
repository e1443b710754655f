"""What the PostgreSQL store adds to the contract (test_store_contract.py runs that one):
its schema and versions, faults of the server, wake-ups by NOTIFY, fencing by
attempt, and claims that skip locked rows.

Real servers only: the session's cluster (and PgBouncer before it) for most tests,
and a cluster of the test's own where one is stopped, restarted or not yet started.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from runtime.clock import ManualClock
from runtime.dispatch.answers import Accepted
from runtime.errors import ConfigError, Conflict, StorageUnavailable
from runtime.jobs.job import Job, JobStatus, new_job_id
from runtime.jobs.store import open_store
from runtime.jobs.stores.postgres import PostgresJobStore
from runtime.jobs.stores.postgres_listen import JobEvent
from runtime.jobs.stores.postgres_schema import SCHEMA_VERSION
from runtime.settings import Settings
from tests.jobs.postgres_fixtures import (
    PgBouncer,
    PostgresCluster,
    pgbouncer_binary,
    started_cluster,
    store_dsn,
)
from tests.support import running_instance, settings_for

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)

TTL_S = 3600.0


@pytest.fixture
def dsn(postgres_cluster: PostgresCluster, postgres_database: str) -> str:
    return postgres_cluster.dsn(postgres_database)


@pytest.fixture
def stores() -> Iterator[list[PostgresJobStore]]:
    """Stores a test opens, closed after it."""
    opened: list[PostgresJobStore] = []
    yield opened
    for store in opened:
        store.close()


def opened(stores: list[PostgresJobStore], dsn: str, **kwargs: Any) -> PostgresJobStore:
    store = PostgresJobStore(dsn, ttl_s=kwargs.pop("ttl_s", TTL_S), **kwargs)
    stores.append(store)
    return store


def queued(store: PostgresJobStore, handler: str = "echo") -> Job:
    job = Job(id=new_job_id(), handler=handler, input={"x": 1})
    store.create(job)
    return job


@pytest.fixture
def own_cluster() -> Iterator[PostgresCluster]:
    """A cluster for one test alone, which it may stop and restart."""
    cluster = started_cluster()
    yield cluster
    cluster.remove()


# -- the URL and the schema --------------------------------------------------------


def test_open_store_picks_postgres_by_scheme(dsn: str, stores: list[PostgresJobStore]) -> None:
    store = open_store(dsn, ttl_s=TTL_S)
    assert isinstance(store, PostgresJobStore)
    stores.append(store)
    job = queued(store)
    assert store.get(job.id) == job


@pytest.mark.parametrize(
    ("url", "complaint"),
    [
        ("postgresql://thaw@127.0.0.1/db?pool_max=0", "pool_max"),
        ("postgresql://thaw@127.0.0.1/db?pool_max=many", "pool_max"),
        ("postgresql://thaw@127.0.0.1/db?no_such_option=1", "no_such_option"),
        ("postgresql://thaw@127.0.0.1/db?prepare=yes", "prepare"),
        ("postgresql://thaw@127.0.0.1/db?listen=postgresql://x/y%3Fbogus%3D1", "listen"),
        ("mysql://thaw:s3cret@127.0.0.1/db", "expected postgresql://"),
        ("postgresql://thaw:s3cret@127.0.0.1:port/db", "port"),
    ],
)
def test_a_malformed_url_is_a_config_error(url: str, complaint: str) -> None:
    with pytest.raises(ConfigError, match=complaint) as refused:
        PostgresJobStore(url, ttl_s=TTL_S)
    assert "s3cret" not in str(refused.value)


def test_the_schema_is_created_once_and_versioned(
    postgres_cluster: PostgresCluster, dsn: str, stores: list[PostgresJobStore]
) -> None:
    first = opened(stores, dsn)
    job = queued(first)
    opened(stores, dsn)  # a second instance finds the tables and keeps the rows
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT version FROM thaw_schema").fetchall() == [(SCHEMA_VERSION,)]
    assert first.get(job.id) == job


def test_instances_starting_together_create_the_schema_once(
    dsn: str, stores: list[PostgresJobStore]
) -> None:
    barrier = threading.Barrier(6)
    errors: list[BaseException] = []

    def start() -> None:
        barrier.wait()
        try:
            stores.append(PostgresJobStore(dsn, ttl_s=TTL_S))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    job = queued(stores[0])
    assert all(store.get(job.id) == job for store in stores)


def test_a_newer_schema_is_refused_naming_both_versions(
    dsn: str, stores: list[PostgresJobStore]
) -> None:
    opened(stores, dsn)
    with psycopg.connect(dsn) as conn:
        conn.execute("UPDATE thaw_schema SET version = %s", (SCHEMA_VERSION + 1,))
    with pytest.raises(ConfigError) as refused:
        PostgresJobStore(dsn, ttl_s=TTL_S)
    message = str(refused.value)
    assert f"schema version {SCHEMA_VERSION + 1}" in message
    assert f"this Thaw's ({SCHEMA_VERSION})" in message


def test_a_role_that_may_not_create_the_tables_is_a_config_error(
    postgres_cluster: PostgresCluster, postgres_database: str
) -> None:
    role = f"reader_{postgres_database}"
    postgres_cluster.execute(f"DROP ROLE IF EXISTS {role}; CREATE ROLE {role} LOGIN")
    postgres_cluster.execute(f"REVOKE CREATE ON SCHEMA public FROM {role}", postgres_database)
    url = f"postgresql://{role}@127.0.0.1:{postgres_cluster.port}/{postgres_database}"
    with pytest.raises(ConfigError, match="cannot create or check its tables"):
        PostgresJobStore(url, ttl_s=TTL_S)


# -- faults of the server ------------------------------------------------------------


def test_an_unreachable_server_at_start_is_storage_unavailable_then_recovers(
    stores: list[PostgresJobStore],
) -> None:
    cluster = started_cluster()
    try:
        cluster.stop()
        # Opening does not fail: the instance serves /healthz, its job routes 503.
        store = opened(stores, cluster.dsn("postgres"))
        with pytest.raises(StorageUnavailable) as down:
            store.get(new_job_id())
        assert down.value.retry_after_s is not None
        assert "127.0.0.1" in str(down.value) and "refused" in str(down.value).lower()
        with pytest.raises(StorageUnavailable):
            queued(store)
        cluster.start()
        job = queued(store)  # no restart of the store: the schema is made now
        assert store.get(job.id) == job
    finally:
        cluster.remove()


def test_a_missing_database_is_storage_unavailable_and_the_password_never_shown(
    postgres_cluster: PostgresCluster, stores: list[PostgresJobStore]
) -> None:
    url = f"postgresql://thaw:s3cret@127.0.0.1:{postgres_cluster.port}/no_such_db"
    store = opened(stores, url)
    with pytest.raises(StorageUnavailable) as refused:
        store.get(new_job_id())
    assert "no_such_db" in str(refused.value)
    assert "s3cret" not in str(refused.value)


@pytest.mark.parametrize("mode", ["fast", "immediate"])
@pytest.mark.parametrize("through", ["direct", "pgbouncer"])
def test_a_restart_mid_run_loses_nothing_acknowledged(
    own_cluster: PostgresCluster, mode: str, through: str, stores: list[PostgresJobStore]
) -> None:
    """Down: every call is StorageUnavailable. Back: the same store object serves
    again by itself, and every write it acknowledged before is there."""
    bouncer = None
    if through == "pgbouncer":
        binary = pgbouncer_binary()
        if binary is None:
            pytest.skip("no pgbouncer binary")
        bouncer = PgBouncer(binary, own_cluster)
    try:
        url = own_cluster.dsn("postgres") if bouncer is None else bouncer.dsn("postgres")
        store = opened(stores, url)
        done = queued(store)
        assert store.claim(done.id, "a", 30.0, 3) is not None
        assert store.finish(done.id, "a", JobStatus.SUCCEEDED, {"y": 1})
        running = queued(store)
        assert store.claim(running.id, "a", 30.0, 3) is not None
        waiting = queued(store)
        own_cluster.stop(mode)
        with pytest.raises(StorageUnavailable):
            store.get(done.id)
        with pytest.raises(StorageUnavailable):
            queued(store)
        own_cluster.start()
        if bouncer is not None:
            # PgBouncer fails clients for `server_login_retry` after a failed login.
            serving_again(store)
        got = store.get(done.id)  # direct: the first call after the restart succeeds
        assert got is not None and got.status is JobStatus.SUCCEEDED and got.output == {"y": 1}
        assert store.heartbeat(running.id, "a", 30.0)
        assert store.lapsed() == [waiting.id]
        assert store.finish(running.id, "a", JobStatus.SUCCEEDED, {"y": 2})
    finally:
        if bouncer is not None:
            bouncer.stop()


def serving_again(store: PostgresJobStore) -> None:
    """Wait until the store serves again, by itself (a bounded wait, not an assertion)."""
    for _ in range(300):
        try:
            store.ping("probe")
            return
        except StorageUnavailable:
            time.sleep(0.1)
    store.ping("probe")


# -- fencing --------------------------------------------------------------------------


def test_a_late_write_of_an_earlier_run_changes_nothing(
    dsn: str, stores: list[PostgresJobStore]
) -> None:
    """The same owner (an instance whose lease lapsed while it was cut off) claims
    its job again: the first run's writes, fenced by its attempt, are refused."""
    clock = ManualClock()
    store = opened(stores, dsn, clock=clock)
    job = queued(store)
    first = store.claim(job.id, "a", 5.0, 3)
    assert first is not None and first.attempts == 1
    clock.advance(6.0)
    second = store.claim(job.id, "a", 5.0, 3)
    assert second is not None and second.attempts == 2
    assert not store.heartbeat(job.id, "a", 5.0, attempt=first.attempts)
    assert not store.set_phase(job.id, "a", "run", {"step": 1}, attempt=first.attempts)
    assert not store.finish(job.id, "a", JobStatus.SUCCEEDED, {"stale": 1}, attempt=1)
    assert store.heartbeat(job.id, "a", 5.0, attempt=second.attempts)
    assert store.set_phase(job.id, "a", "run", {"step": 2}, attempt=second.attempts)
    assert store.finish(job.id, "a", JobStatus.SUCCEEDED, {"fresh": 2}, attempt=2)
    got = store.get(job.id)
    assert got is not None and got.output == {"fresh": 2} and got.attempts == 2


def test_leases_and_expiry_follow_the_injected_clock(
    dsn: str, stores: list[PostgresJobStore]
) -> None:
    clock = ManualClock()
    store = opened(stores, dsn, clock=clock, ttl_s=100.0)
    job = queued(store)
    assert job.created_at == clock.wall() and job.expires_at == clock.wall() + 100.0
    assert store.claim(job.id, "a", 10.0, 3) is not None
    clock.advance(9.0)
    assert store.lapsed() == []
    clock.advance(2.0)
    assert store.lapsed() == [job.id]
    clock.advance(100.0)
    assert store.get(job.id) is None
    assert store.purge_expired() == 1


# -- claims never wait on each other ---------------------------------------------------


@pytest.fixture
def holder(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """A session that holds row locks in an open transaction, as a slow claimer would.
    The server ends it after 30 s, so a claim that waited on it fails, never hangs."""
    with psycopg.connect(dsn) as conn:
        conn.execute("SET idle_in_transaction_session_timeout = '30s'")
        yield conn


def test_claims_skip_a_row_another_claimer_holds(
    dsn: str, stores: list[PostgresJobStore], holder: psycopg.Connection[Any]
) -> None:
    store = opened(stores, dsn)
    oldest, newer = queued(store), queued(store)
    holder.execute("SELECT id FROM thaw_jobs WHERE id = %s FOR UPDATE", (oldest.id,))
    assert store.claim(oldest.id, "b", 30.0, 3) is None
    taken = store.claim_next("b", 30.0, 3)
    assert taken is not None and taken.id == newer.id
    assert store.claim_next("b", 30.0, 3) is None
    holder.commit()  # still alive: nothing waited for its lock
    taken = store.claim_next("b", 30.0, 3)
    assert taken is not None and taken.id == oldest.id and taken.attempts == 1


def test_claim_next_takes_the_oldest_queued_job_of_the_handlers_asked(
    dsn: str, stores: list[PostgresJobStore]
) -> None:
    clock = ManualClock()
    store = opened(stores, dsn, clock=clock)
    embed = queued(store, "embed")
    clock.advance(1.0)
    chat = queued(store, "chat")
    clock.advance(1.0)
    embed2 = queued(store, "embed")
    first = store.claim_next("a", 30.0, 3, handlers=["chat"])
    assert first is not None and first.id == chat.id and first.owner == "a"
    assert store.claim_next("a", 30.0, 3, handlers=["chat"]) is None
    for expected in (embed, embed2):
        taken = store.claim_next("a", 30.0, 3)
        assert taken is not None and taken.id == expected.id
    assert store.claim_next("a", 30.0, 3) is None


def test_racing_claimers_of_one_queue_each_take_different_jobs(
    dsn: str, stores: list[PostgresJobStore]
) -> None:
    claimers = [opened(stores, dsn) for _ in range(8)]
    jobs = {queued(claimers[0]).id for _ in range(40)}
    taken: list[str] = []
    lock = threading.Lock()

    def drain(store: PostgresJobStore, owner: str) -> None:
        while (job := store.claim_next(owner, 30.0, 3)) is not None:
            with lock:
                taken.append(job.id)

    threads = [
        threading.Thread(target=drain, args=(store, f"owner-{i}"))
        for i, store in enumerate(claimers)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(taken) == sorted(jobs)


def test_prepared_statements_when_asked_straight_to_the_server(
    dsn: str, stores: list[PostgresJobStore]
) -> None:
    """`prepare=1`: psycopg prepares each statement from its fifth run on; the
    same calls (and claim_next with and without a handler filter) still hold."""
    store = opened(stores, f"{dsn}?prepare=1")
    for round_ in range(8):
        job = queued(store, "embed" if round_ % 2 else "chat")
        taken = store.claim_next("a", 30.0, 3, handlers=None if round_ % 2 else ["chat"])
        assert taken is not None and taken.id == job.id
        assert store.heartbeat(job.id, "a", 30.0, attempt=1)
        assert store.finish(job.id, "a", JobStatus.SUCCEEDED, {"round": round_})
        got = store.get(job.id)
        assert got is not None and got.output == {"round": round_}


def test_an_id_twice_in_one_batch_keeps_the_first(dsn: str, stores: list[PostgresJobStore]) -> None:
    store = opened(stores, dsn)
    job_id = new_job_id()
    first, again = (
        Job(id=job_id, handler="first", input={}),
        Job(id=job_id, handler="again", input={}),
    )
    outcomes = store.create_many([first, again])
    assert outcomes[0] is None and isinstance(outcomes[1], Conflict)
    got = store.get(job_id)
    assert got is not None and got.handler == "first"
    assert store.create_many([]) == []


def test_purge_deletes_in_batches(dsn: str, stores: list[PostgresJobStore]) -> None:
    clock = ManualClock()
    store = opened(stores, dsn, clock=clock, ttl_s=10.0)
    store.create_many([Job(id=new_job_id(), handler="echo", input={}) for _ in range(7)])
    clock.advance(5.0)
    live = queued(store)
    clock.advance(6.0)
    assert store.purge_expired(batch=3) == 7
    assert store.get(live.id) == live


# -- wake-ups -----------------------------------------------------------------------


@pytest.mark.parametrize("through", ["postgres", "pgbouncer"])
def test_writes_on_one_store_wake_the_listener_of_another_in_commit_order(
    request: pytest.FixtureRequest, through: str, stores: list[PostgresJobStore]
) -> None:
    url = store_dsn(request, through == "pgbouncer")
    listening, writing = opened(stores, url), opened(stores, url)
    events: queue.Queue[JobEvent] = queue.Queue()
    listener = listening.listen(events.put)
    assert listener.listening.wait(30)
    job = queued(writing, "embed")
    assert writing.claim(job.id, "b", 30.0, 3) is not None
    assert writing.heartbeat(job.id, "b", 30.0)  # a lease renewal wakes no one
    assert writing.set_phase(job.id, "b", "run", {"step": 1})
    assert writing.finish(job.id, "b", JobStatus.SUCCEEDED, {"y": 1})
    other = queued(writing)
    writing.cancel(other.id)
    assert not writing.finish(job.id, "b", JobStatus.FAILED)  # refused: no wake-up
    seen = [events.get(timeout=30) for _ in range(6)]
    assert seen == [
        JobEvent(job.id, "queued", "embed"),
        JobEvent(job.id, "running", "embed"),
        JobEvent(job.id, "running", "embed"),
        JobEvent(job.id, "succeeded", "embed"),
        JobEvent(other.id, "queued", "echo"),
        JobEvent(other.id, "cancelled", "echo"),
    ]
    # Nothing else was sent: a marker written last is the next event.
    marker = queued(writing, "marker")
    assert events.get(timeout=30) == JobEvent(marker.id, "queued", "marker")


def test_a_job_lost_for_good_wakes_its_waiters(dsn: str, stores: list[PostgresJobStore]) -> None:
    clock = ManualClock()
    store = opened(stores, dsn, clock=clock)
    events: queue.Queue[JobEvent] = queue.Queue()
    assert store.listen(events.put).listening.wait(30)
    job = queued(store)
    assert store.claim(job.id, "a", 5.0, 1) is not None
    clock.advance(6.0)
    assert store.claim(job.id, "b", 5.0, 1) is None
    seen = [events.get(timeout=30) for _ in range(3)]
    assert [event.status for event in seen] == ["queued", "running", "failed"]


def test_the_listener_comes_back_after_a_restart_and_says_what_it_may_have_missed(
    own_cluster: PostgresCluster, stores: list[PostgresJobStore]
) -> None:
    store = opened(stores, own_cluster.dsn("postgres"))
    events: queue.Queue[JobEvent | None] = queue.Queue()
    listener = store.listen(events.put, lambda: events.put(None))
    assert listener.listening.wait(30)
    # Listening at last is a gap too: what changed before it was heard by nobody.
    assert events.get(timeout=30) is None
    own_cluster.restart()
    assert events.get(timeout=30) is None  # the gap: waiters read again
    assert listener.listening.is_set()
    job = queued(store)
    assert events.get(timeout=30) == JobEvent(job.id, "queued", "echo")


def test_a_callback_that_raises_does_not_stop_the_listener(
    dsn: str, stores: list[PostgresJobStore]
) -> None:
    store = opened(stores, dsn)
    events: queue.Queue[JobEvent] = queue.Queue()

    def on_event(event: JobEvent) -> None:
        events.put(event)
        if event.handler == "boom":
            raise RuntimeError("a consumer's bug")

    assert store.listen(on_event).listening.wait(30)
    boom = queued(store, "boom")
    after = queued(store)
    assert events.get(timeout=30) == JobEvent(boom.id, "queued", "boom")
    assert events.get(timeout=30) == JobEvent(after.id, "queued", "echo")


# -- the runtime on it ----------------------------------------------------------------


@pytest.mark.anyio
async def test_an_instance_keeps_its_jobs_in_postgres_where_another_reads_them(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Two instances in-process on one database, through PgBouncer: a job the first
    accepts (its deadline passed) succeeds there, and the second answers its poll."""
    url = store_dsn(request, True)

    def settings(name: str) -> Settings:
        return settings_for(
            tmp_path / name,
            bundle_source=str(tmp_path / "bundles"),
            job_store=url,
            handlers=("tests.handlers.sleepy",),
        )

    async with running_instance(settings("a")) as a, running_instance(settings("b")) as b:
        outcome = await a.dispatcher.invoke("sleepy", {"s": 0.6}, wait_s=0.2, request_id="r1")
        assert isinstance(outcome, Accepted)
        done = await a.jobs.get(outcome.job.id, key_id=None, wait_s=30.0)
        assert done.status is JobStatus.SUCCEEDED and done.output["slept_s"] == 0.6
        seen = await b.jobs.get(outcome.job.id, key_id=None)
        assert seen.status is JobStatus.SUCCEEDED and seen.output == done.output
        assert seen.owner == a.jobs.owner and seen.attempts == 1
