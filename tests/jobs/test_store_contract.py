"""One contract, every job store: SQLite (a temp file), DynamoDB + S3 (a moto server),
and PostgreSQL (a throwaway cluster), directly and through PgBouncer in transaction mode.

Each test states one rule of `runtime.jobs.store.JobStore` and runs against every
store. A store is opened through a factory so a test can open a second
instance on the same data (another Lambda instance, or a restart). Every store
of a test shares one `ManualClock`: leases lapse and records expire when the
test advances it, never by waiting.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from runtime.clock import ManualClock
from runtime.errors import Conflict, WorkerLost
from runtime.jobs.job import Job, JobStatus, new_job_id
from runtime.jobs.store import NOT_NOW, JobStore
from runtime.jobs.stores.dynamodb import DynamoDBJobStore
from runtime.jobs.stores.sqlite import SQLiteJobStore
from tests import aws_fixtures
from tests.aws_fixtures import client, make_bucket, make_jobs_table
from tests.jobs import postgres_fixtures

moto_endpoint = aws_fixtures.moto_endpoint  # fixture: the session's moto server (DynamoDB runs)

OpenStore = Callable[..., JobStore]
LEASE_S = 30.0
# Past a lease of LEASE_S: on the test's clock, so it costs no time at all.
LAPSE_S = LEASE_S + 1.0


@pytest.fixture
def clock() -> ManualClock:
    """The time of every store a test opens (they share it, as instances share the wall)."""
    return ManualClock()


# "sqlite-3.34": the SQLite store as it runs where SQLite has no RETURNING (before 3.35).
@pytest.fixture(params=["sqlite", "sqlite-3.34", "dynamodb", "postgres", "pgbouncer"])
def open_store(
    request: pytest.FixtureRequest, tmp_path: Path, clock: ManualClock
) -> Iterator[OpenStore]:
    """Opens a store on this test's data; every call is a new instance."""
    opened: list[JobStore] = []
    if request.param.startswith("sqlite"):
        path = tmp_path / "jobs.sqlite3"
        returning = request.param == "sqlite"

        def make(ttl_s: float) -> JobStore:
            return SQLiteJobStore(path, ttl_s=ttl_s, clock=clock, returning=returning)

    elif request.param in ("postgres", "pgbouncer"):
        pytest.importorskip("psycopg", reason="the postgres extra: pip install -e '.[postgres]'")
        from runtime.jobs.stores.postgres import PostgresJobStore

        dsn = postgres_fixtures.store_dsn(request, request.param == "pgbouncer")

        def make(ttl_s: float) -> JobStore:
            return PostgresJobStore(dsn, ttl_s=ttl_s, clock=clock)

    else:
        endpoint = request.getfixturevalue("moto_endpoint")
        table, bucket = make_jobs_table(endpoint), make_bucket(endpoint)

        def make(ttl_s: float) -> JobStore:
            return DynamoDBJobStore(
                table,
                ttl_s=ttl_s,
                clock=clock,
                bucket=bucket,
                client=client(endpoint, "dynamodb"),
                s3_client=client(endpoint, "s3"),
            )

    def factory(ttl_s: float = 3600.0) -> JobStore:
        store = make(ttl_s)
        opened.append(store)
        return store

    yield factory
    for store in opened:
        store.close()


@pytest.fixture
def store(open_store: OpenStore) -> JobStore:
    return open_store()


def queued(store: JobStore, payload: Any = None, **fields: Any) -> Job:
    job = Job(id=new_job_id(), handler="echo", input=payload or {"x": 1}, **fields)
    store.create(job)
    return job


def running(store: JobStore, owner: str = "a", lease_s: float = 30.0) -> Job:
    job = queued(store)
    claimed = store.claim(job.id, owner, lease_s, 3)
    assert claimed is not None
    return claimed


# -- create / get ---------------------------------------------------------------


def test_create_then_get_round_trips_every_field(store: JobStore, clock: ManualClock) -> None:
    payload = {"floats": [0.1, 1e-300, 1.7976931348623157e308, -0.0], "text": "é ✓", "n": None}
    job = queued(store, payload, key_id="key-1")
    got = store.get(job.id)
    assert got is not None
    assert got == job
    assert got.input == payload
    assert got.status is JobStatus.QUEUED and got.attempts == 0
    assert got.created_at == job.created_at == clock.wall()
    assert got.expires_at > clock.wall()


def test_get_unknown_is_none(store: JobStore) -> None:
    assert store.get(new_job_id()) is None


def test_create_refuses_a_used_id(store: JobStore) -> None:
    job = queued(store)
    with pytest.raises((Conflict, sqlite3.IntegrityError)):
        store.create(Job(id=job.id, handler="other", input={}))
    got = store.get(job.id)
    assert got is not None and got.handler == "echo"


def test_create_many_stores_all_and_refuses_only_a_used_id(store: JobStore) -> None:
    used = queued(store)
    fresh = [Job(id=new_job_id(), handler="echo", input={"i": i}) for i in range(3)]
    batch = [fresh[0], Job(id=used.id, handler="other", input={}), *fresh[1:]]
    outcomes = store.create_many(batch)
    assert [type(o) for o in outcomes] == [type(None), Conflict, type(None), type(None)]
    for job in fresh:
        got = store.get(job.id)
        assert got is not None and got.input == job.input
    kept = store.get(used.id)
    assert kept is not None and kept.handler == "echo"


# -- claim ------------------------------------------------------------------------


def test_claim_takes_a_queued_job(store: JobStore, clock: ManualClock) -> None:
    job = queued(store)
    before = clock.wall()
    claimed = store.claim(job.id, "a", 30.0, 3)
    assert claimed is not None
    assert claimed.status is JobStatus.RUNNING and claimed.phase == "claimed"
    assert claimed.owner == "a" and claimed.attempts == 1
    assert claimed.lease_until is not None and claimed.lease_until >= before + 30.0
    assert store.get(job.id) == claimed


def test_a_leased_job_cannot_be_claimed_again(store: JobStore) -> None:
    job = running(store, "a")
    assert store.claim(job.id, "b", 30.0, 3) is None
    assert store.claim(job.id, "a", 30.0, 3) is None
    got = store.get(job.id)
    assert got is not None and got.owner == "a" and got.attempts == 1


def test_claim_of_unknown_job_is_none(store: JobStore) -> None:
    assert store.claim(new_job_id(), "a", 30.0, 3) is None


def test_racing_claimers_exactly_one_wins(open_store: OpenStore) -> None:
    claimers = 6
    instances = [open_store() for _ in range(claimers)]  # one store per "instance"
    jobs = [queued(instances[0]) for _ in range(4)]
    for job in jobs:
        barrier = threading.Barrier(claimers)
        winners: list[str] = []

        def race(index: int, job_id: str, barrier: threading.Barrier, winners: list[str]) -> None:
            barrier.wait()
            if instances[index].claim(job_id, f"owner-{index}", 30.0, 3) is not None:
                winners.append(f"owner-{index}")

        threads = [
            threading.Thread(target=race, args=(i, job.id, barrier, winners))
            for i in range(claimers)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert len(winners) == 1, winners
        got = instances[0].get(job.id)
        assert got is not None and got.owner == winners[0] and got.attempts == 1


# -- heartbeat / set_phase ---------------------------------------------------------


def test_heartbeat_renews_only_the_owners_lease(store: JobStore, clock: ManualClock) -> None:
    job = running(store, "a", lease_s=5.0)
    clock.advance(4.0)
    assert store.heartbeat(job.id, "a", 60.0)
    got = store.get(job.id)
    assert got is not None and got.lease_until == clock.wall() + 60.0
    clock.advance(50.0)  # past the first lease, within the renewed one
    assert store.claim(job.id, "b", 60.0, 3) is None
    assert not store.heartbeat(job.id, "b", 60.0)
    assert not store.heartbeat(new_job_id(), "a", 60.0)


def test_heartbeat_of_a_queued_job_is_refused(store: JobStore) -> None:
    job = queued(store)
    assert not store.heartbeat(job.id, "a", 60.0)


def test_set_phase_by_the_owner_is_visible(store: JobStore) -> None:
    job = running(store, "a")
    progress = {"bytes": 10, "total_bytes": 100, "ratio": 0.1}
    assert store.set_phase(job.id, "a", "fetch", progress)
    got = store.get(job.id)
    assert got is not None and got.phase == "fetch" and got.progress == progress
    assert store.set_phase(job.id, "a", "load")
    got = store.get(job.id)
    assert got is not None and got.phase == "load" and got.progress is None
    assert not store.set_phase(job.id, "b", "run")


# -- finish ---------------------------------------------------------------------


def test_finish_only_by_the_owner(store: JobStore) -> None:
    job = running(store, "a")
    assert not store.finish(job.id, "b", JobStatus.SUCCEEDED, {"y": 2})
    got = store.get(job.id)
    assert got is not None and got.status is JobStatus.RUNNING and got.output is None
    store.set_phase(job.id, "a", "run", {"step": 1})
    final = store.finish(job.id, "a", JobStatus.SUCCEEDED, {"y": 2.5})
    got = store.get(job.id)
    assert got is not None
    # The write answers with the record as stored: its caller needs no read of its own.
    assert final == got
    assert got.status is JobStatus.SUCCEEDED and got.phase == "succeeded"
    assert got.output == {"y": 2.5} and got.error is None
    assert got.lease_until is None and got.progress is None
    assert not store.finish(job.id, "a", JobStatus.FAILED, error={"type": "x", "message": "m"})
    assert not store.heartbeat(job.id, "a", 30.0)


def test_finish_failed_records_the_error(store: JobStore) -> None:
    job = running(store, "a")
    error = {"type": "handler-error", "message": "boom"}
    final = store.finish(job.id, "a", JobStatus.FAILED, error=error)
    got = store.get(job.id)
    assert got is not None and got.status is JobStatus.FAILED and got.error == error
    assert final == got


def test_finish_needs_a_final_status(store: JobStore) -> None:
    job = running(store, "a")
    with pytest.raises(ValueError):
        store.finish(job.id, "a", JobStatus.RUNNING)


def test_finish_of_a_queued_job_is_refused(store: JobStore) -> None:
    job = queued(store)
    assert not store.finish(job.id, "a", JobStatus.SUCCEEDED, {})


# -- cancel ---------------------------------------------------------------------


def test_cancel_a_queued_job(store: JobStore) -> None:
    job = queued(store)
    got = store.cancel(job.id)
    assert got is not None and got.status is JobStatus.CANCELLED and got.phase == "cancelled"
    assert got.error is not None and got.error["type"] == "cancelled"
    assert store.claim(job.id, "a", 30.0, 3) is None
    assert job.id not in store.lapsed()


def test_cancel_a_running_job_revokes_the_owner(store: JobStore) -> None:
    job = running(store, "a")
    got = store.cancel(job.id)
    assert got is not None and got.status is JobStatus.CANCELLED
    assert not store.heartbeat(job.id, "a", 30.0)
    assert not store.set_phase(job.id, "a", "run")
    assert not store.finish(job.id, "a", JobStatus.SUCCEEDED, {"late": True})
    got = store.get(job.id)
    assert got is not None and got.status is JobStatus.CANCELLED and got.output is None


def test_cancel_a_finished_job_changes_nothing(store: JobStore) -> None:
    job = running(store, "a")
    store.finish(job.id, "a", JobStatus.SUCCEEDED, {"y": 1})
    got = store.cancel(job.id)
    assert got is not None and got.status is JobStatus.SUCCEEDED and got.output == {"y": 1}


def test_cancel_unknown_is_none(store: JobStore) -> None:
    assert store.cancel(new_job_id()) is None


# -- leases ---------------------------------------------------------------------


def test_a_lapsed_lease_is_claimed_again_with_one_more_attempt(
    open_store: OpenStore, clock: ManualClock
) -> None:
    first, second = open_store(), open_store()
    job = running(first, "a", lease_s=LEASE_S)
    clock.advance(LEASE_S - 1.0)
    assert job.id not in second.lapsed()
    assert second.claim(job.id, "b", 30.0, 3) is None
    clock.advance(LAPSE_S - (LEASE_S - 1.0))
    assert job.id in second.lapsed()
    again = second.claim(job.id, "b", 30.0, 3)
    assert again is not None and again.owner == "b" and again.attempts == 2
    assert again.status is JobStatus.RUNNING
    assert not first.heartbeat(job.id, "a", 30.0)
    assert not first.finish(job.id, "a", JobStatus.SUCCEEDED, {"stale": True})
    assert second.finish(job.id, "b", JobStatus.SUCCEEDED, {"fresh": True})
    got = first.get(job.id)
    assert got is not None and got.output == {"fresh": True}


def test_attempts_exhausted_fails_the_job_as_worker_lost(
    store: JobStore, clock: ManualClock
) -> None:
    job = queued(store)
    for attempt, owner in enumerate(("a", "b"), start=1):
        claimed = store.claim(job.id, owner, LEASE_S, 2)
        assert claimed is not None and claimed.attempts == attempt
        clock.advance(LAPSE_S)
    assert store.claim(job.id, "c", 30.0, 2) is None
    got = store.get(job.id)
    assert got is not None and got.status is JobStatus.FAILED and got.phase == "failed"
    assert got.error is not None and got.error["type"] == WorkerLost.slug
    assert got.attempts == 2
    assert job.id not in store.lapsed()
    assert store.claim(job.id, "d", 30.0, 5) is None


# -- lapsed() -----------------------------------------------------------------------


def test_lapsed_lists_queued_and_lease_lapsed_jobs_oldest_first(
    store: JobStore, clock: ManualClock
) -> None:
    made: list[Job] = []
    for make in (
        lambda: queued(store),
        lambda: running(store, "a", lease_s=600.0),
        lambda: running(store, "b", lease_s=LEASE_S),
        lambda: running(store, "c"),
        lambda: queued(store),
    ):
        made.append(make())
        clock.advance(0.001)  # each created a moment after the last
    first, live, lapsing, done, last = made
    store.finish(done.id, "c", JobStatus.SUCCEEDED, {})
    assert store.lapsed() == [first.id, last.id]
    clock.advance(LAPSE_S)
    listed = store.lapsed()
    assert listed == [first.id, lapsing.id, last.id]
    assert live.id not in listed
    assert store.lapsed(limit=2) == [first.id, lapsing.id]


# -- expiry -------------------------------------------------------------------------


def test_expired_jobs_are_absent_then_purged(open_store: OpenStore, clock: ManualClock) -> None:
    store = open_store(ttl_s=60.0)
    job = queued(store)
    clock.advance(59.0)
    assert store.get(job.id) is not None
    assert store.purge_expired() == 0
    clock.advance(job.expires_at - clock.wall() + 0.1)
    assert store.get(job.id) is None
    assert store.claim(job.id, "a", 30.0, 3) is None
    assert job.id not in store.lapsed()
    assert store.cancel(job.id) is None
    assert store.purge_expired() >= 1
    assert store.purge_expired() == 0


def test_ttl_counts_from_the_end_and_heartbeats_keep_running_jobs(
    open_store: OpenStore, clock: ManualClock
) -> None:
    store = open_store(ttl_s=60.0)
    job = running(store, lease_s=600.0)
    clock.advance(36.0)
    assert store.heartbeat(job.id, "a", 600.0)
    clock.advance(48.0)  # past the TTL counted from creation, not from the heartbeat
    assert store.get(job.id) is not None, "a heartbeated job expired under its worker"
    assert store.finish(job.id, "a", JobStatus.SUCCEEDED, output={"ok": True})
    finished = store.get(job.id)
    assert finished is not None and finished.expires_at >= clock.wall() + 60.0
    clock.advance(59.0)
    assert store.get(job.id) is not None
    clock.advance(finished.expires_at - clock.wall() + 0.1)
    assert store.get(job.id) is None


def test_purge_keeps_live_jobs(store: JobStore) -> None:
    job = queued(store)
    assert store.purge_expired() == 0
    assert store.get(job.id) is not None


# -- size and persistence ---------------------------------------------------------


def test_large_input_and_output_round_trip(store: JobStore) -> None:
    big_input = {"texts": ["a long sentence " * 40] * 800}  # ~520 KB serialized
    job = queued(store, big_input)
    claimed = store.claim(job.id, "a", 30.0, 3)
    assert claimed is not None and claimed.input == big_input
    output = {"embeddings": [[i / 7 for i in range(384)] for _ in range(40)]}  # > 400 KB
    assert store.finish(job.id, "a", JobStatus.SUCCEEDED, output)
    got = store.get(job.id)
    assert got is not None and got.output == output and got.input == big_input


@pytest.mark.parametrize("scale", [1, 2000], ids=["small", "large"])
def test_every_record_counts_the_bytes_its_payloads_are_stored_in(
    store: JobStore, scale: int
) -> None:
    """What a record costs the memory of finished jobs is known from the store's own
    bytes, inline or (DynamoDB, past its item limit) in S3: no serialization again."""
    given = {"text": "x" * 100 * scale}
    job = queued(store, given)
    size_in = len(orjson.dumps(given))
    claimed = store.claim(job.id, "a", 30.0, 3)
    assert claimed is not None and claimed.payload_bytes == size_in
    output = {"values": [i / 7 for i in range(10 * scale)]}
    # An output the caller encoded already (an orjson.Fragment) is written as it is.
    encoded = orjson.dumps(output)
    final = store.finish(job.id, "a", JobStatus.SUCCEEDED, orjson.Fragment(encoded))
    assert final is not None and final.output == output
    assert final.payload_bytes == size_in + len(encoded)
    got = store.get(job.id)
    assert got == final and got is not None and got.payload_bytes == final.payload_bytes


def test_jobs_survive_reopening_the_store(open_store: OpenStore) -> None:
    before = open_store()
    job = running(before, "a")
    waiting = queued(before)
    before.close()
    after = open_store()
    got = after.get(job.id)
    assert got is not None and got.status is JobStatus.RUNNING and got.owner == "a"
    assert after.heartbeat(job.id, "a", 30.0)
    assert after.finish(job.id, "a", JobStatus.SUCCEEDED, {"ok": True})
    assert after.lapsed() == [waiting.id]
    assert after.get(waiting.id) == waiting


# -- dead owners: claim_orphan() and owned() ------------------------------------------


def test_owned_lists_the_running_jobs_of_one_owner_whatever_their_lease(
    store: JobStore, clock: ManualClock
) -> None:
    made: list[Job] = []
    for make in (
        lambda: running(store, "dead", lease_s=600.0),
        lambda: running(store, "dead", lease_s=LEASE_S),
        lambda: running(store, "alive", lease_s=600.0),
        lambda: running(store, "dead"),
        lambda: queued(store),
    ):
        made.append(make())
        clock.advance(0.001)  # each created a moment after the last
    first, lapsed, other, done, waiting = made
    store.finish(done.id, "dead", JobStatus.SUCCEEDED, {})
    clock.advance(LAPSE_S)
    assert store.owned("dead") == [first.id, lapsed.id]
    assert store.owned("dead", limit=1) == [first.id]
    assert store.owned("alive") == [other.id]
    assert store.owned("nobody") == []
    assert waiting.id not in store.owned("dead")


def test_claim_orphan_takes_a_dead_owners_job_before_its_lease_lapses(
    store: JobStore, clock: ManualClock
) -> None:
    job = running(store, "dead", lease_s=600.0)
    before = clock.wall()
    claimed = store.claim_orphan(job.id, "dead", "heir", 30.0, 3)
    assert claimed is not None
    assert claimed.owner == "heir" and claimed.attempts == 2
    assert claimed.status is JobStatus.RUNNING and claimed.phase == "claimed"
    assert claimed.lease_until is not None and claimed.lease_until >= before + 30.0
    # The dead owner holds nothing any more; the heir does.
    assert not store.heartbeat(job.id, "dead", 30.0)
    assert not store.finish(job.id, "dead", JobStatus.SUCCEEDED, {"stale": True})
    assert store.finish(job.id, "heir", JobStatus.SUCCEEDED, {"fresh": True})
    got = store.get(job.id)
    assert got is not None and got.output == {"fresh": True}
    assert store.owned("dead") == []


def test_claim_orphan_takes_only_a_running_job_of_that_owner(store: JobStore) -> None:
    alive = running(store, "alive", lease_s=600.0)
    assert store.claim_orphan(alive.id, "dead", "heir", 30.0, 3) is None
    waiting = queued(store)
    assert store.claim_orphan(waiting.id, "dead", "heir", 30.0, 3) is None
    done = running(store, "dead")
    store.finish(done.id, "dead", JobStatus.SUCCEEDED, {"y": 1})
    assert store.claim_orphan(done.id, "dead", "heir", 30.0, 3) is None
    cancelled = running(store, "dead")
    store.cancel(cancelled.id)
    assert store.claim_orphan(cancelled.id, "dead", "heir", 30.0, 3) is None
    assert store.claim_orphan(new_job_id(), "dead", "heir", 30.0, 3) is None
    for job, status, owner in (
        (alive, JobStatus.RUNNING, "alive"),
        (waiting, JobStatus.QUEUED, None),
        (done, JobStatus.SUCCEEDED, "dead"),
        (cancelled, JobStatus.CANCELLED, "dead"),
    ):
        got = store.get(job.id)
        assert got is not None and got.status is status and got.owner == owner
    final = store.get(done.id)
    assert final is not None and final.output == {"y": 1} and final.attempts == 1


def test_claim_orphan_out_of_attempts_fails_the_job_as_worker_lost(store: JobStore) -> None:
    job = running(store, "dead", lease_s=600.0)  # attempt 1 of 1
    assert store.claim_orphan(job.id, "dead", "heir", 30.0, 1) is None
    got = store.get(job.id)
    assert got is not None and got.status is JobStatus.FAILED and got.phase == "failed"
    assert got.error is not None and got.error["type"] == WorkerLost.slug
    assert got.attempts == 1
    assert store.owned("dead") == []


def test_racing_orphan_claimers_exactly_one_wins(open_store: OpenStore) -> None:
    claimers = 6
    instances = [open_store() for _ in range(claimers)]
    job = running(instances[0], "dead", lease_s=600.0)
    barrier = threading.Barrier(claimers)
    winners: list[str] = []

    def race(index: int) -> None:
        barrier.wait()
        if instances[index].claim_orphan(job.id, "dead", f"heir-{index}", 30.0, 3) is not None:
            winners.append(f"heir-{index}")

    threads = [threading.Thread(target=race, args=(i,)) for i in range(claimers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(winners) == 1, winners
    got = instances[0].get(job.id)
    assert got is not None and got.owner == winners[0] and got.attempts == 2


# -- ping() -------------------------------------------------------------------------


def test_ping_writes_and_changes_no_job(store: JobStore) -> None:
    job = running(store, "a")
    store.ping("a")
    store.ping("b")
    assert store.get(job.id) == job
    assert store.lapsed() == []
    assert store.purge_expired() == 0


# -- now: a call at once on the caller's thread, or nothing done ------------------


def test_now_runs_the_call_or_answers_not_now_having_done_nothing(store: JobStore) -> None:
    """A store may run a small call at once (SQLite: on the caller's thread) or say
    NOT_NOW; either way the call's effect is there exactly once after a thread runs
    what NOT_NOW left (as runtime/jobs/store_access.py does)."""
    job = Job(id=new_job_id(), handler="echo", input={"x": 1})
    made = store.now(lambda: store.create_many([job]), writes=True)
    if made is NOT_NOW:
        assert store.get(job.id) is None, "NOT_NOW, but the call ran"
        assert in_thread(lambda: store.create_many([job])) == [None]
    else:
        assert made == [None]
    got = store.now(lambda: store.get(job.id), writes=False)
    got = in_thread(lambda: store.get(job.id)) if got is NOT_NOW else got
    assert isinstance(got, Job) and got.id == job.id and got.input == {"x": 1}
    # Stored once: a second create of the id is a conflict, however it runs.
    again = store.now(lambda: store.create_many([job]), writes=True)
    again = in_thread(lambda: store.create_many([job])) if again is NOT_NOW else again
    assert isinstance(again[0], Conflict)


def in_thread(fn: Callable[[], Any]) -> Any:
    """`fn()` on a thread of its own (a store call NOT_NOW left for a thread)."""
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(fn()))
    thread.start()
    thread.join(60)
    return box[0]
