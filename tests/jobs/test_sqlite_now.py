"""SQLite calls run at once on the caller's thread (`SQLiteFile.now`), on a real file.

A call runs now only when nothing can make it wait; otherwise it answers NOT_NOW
having done nothing, and a thread runs it as before. A write run now is one
transaction, durable when it returns (another connection reads it); the log it
writes is copied into the database by a worker thread, never by the caller.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.errors import StorageUnavailable
from runtime.jobs.job import Job, JobStatus
from runtime.jobs.store import NOT_NOW
from runtime.jobs.stores.sqlite import SQLiteJobStore
from tests.jobs import tmpfs
from tests.jobs.test_sqlite_faults import in_another_thread as in_thread
from tests.jobs.test_sqlite_faults import new_job
from tests.support import until


def stored_ids(path: Path) -> set[str]:
    """The job ids another connection (another process, as far as SQLite knows) reads."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return {row[0] for row in conn.execute("SELECT id FROM jobs")}
    finally:
        conn.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteJobStore]:
    opened = SQLiteJobStore(tmp_path / "jobs.sqlite3", ttl_s=60.0)
    yield opened
    opened.close()


def create_now(store: SQLiteJobStore, job: Job) -> object:
    return store.now(lambda: store.create_many([job]), writes=True)


def test_a_write_run_now_is_durable_when_it_returns(store: SQLiteJobStore) -> None:
    job = new_job()
    assert create_now(store, job) == [None]
    assert job.id in stored_ids(store.path)
    finished = store.now(
        lambda: store.finish(job.id, "a", JobStatus.SUCCEEDED, {"y": 2}, attempt=1), writes=True
    )
    assert isinstance(finished, Job) and finished.status is JobStatus.SUCCEEDED
    read = store.now(lambda: store.get(job.id), writes=False)
    assert isinstance(read, Job) and read.status is JobStatus.SUCCEEDED and read.output == {"y": 2}


def test_a_write_lock_held_elsewhere_is_not_now_and_nothing_is_written(
    store: SQLiteJobStore,
) -> None:
    """Another process writing: NOT_NOW at once (no busy wait on the loop); reads still
    run now (WAL readers never wait); the write then lands through a thread."""
    kept = new_job()
    assert create_now(store, kept) == [None]
    other = sqlite3.connect(store.path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # SQLite's write lock, held by another connection
    try:
        job = new_job()
        assert create_now(store, job) is NOT_NOW
        read = store.now(lambda: store.get(kept.id), writes=False)
        assert isinstance(read, Job) and read.id == kept.id
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert job.id not in stored_ids(store.path)
    assert in_thread(lambda: store.create_many([job])) == [None]
    assert job.id in stored_ids(store.path)


def test_this_processs_writer_holding_the_lock_makes_writes_not_now(
    store: SQLiteJobStore,
) -> None:
    entered, release = threading.Event(), threading.Event()

    def slow_write() -> list[object]:
        with store.db.transaction("a long write"):
            entered.set()
            release.wait(30)
        return []

    writer = threading.Thread(target=slow_write)
    writer.start()
    try:
        assert entered.wait(30)
        job = new_job()
        assert create_now(store, job) is NOT_NOW
        assert job.id not in stored_ids(store.path)
    finally:
        release.set()
        writer.join(30)
    assert create_now(store, new_job()) == [None]


def test_a_read_only_call_that_writes_is_not_now(store: SQLiteJobStore) -> None:
    job = new_job()
    assert store.now(lambda: store.create_many([job]), writes=False) is NOT_NOW
    assert job.id not in stored_ids(store.path)


def test_a_deleted_database_is_not_now_until_a_thread_reopened_the_path(
    store: SQLiteJobStore,
) -> None:
    """Reopening (and logging it) is a thread's work: the loop is never the one to."""
    before = new_job()
    assert create_now(store, before) == [None]
    for suffix in ("", "-wal", "-shm"):
        Path(f"{store.path}{suffix}").unlink(missing_ok=True)
    job = new_job()
    assert create_now(store, job) is NOT_NOW
    assert in_thread(lambda: store.create_many([job])) == [None]  # reopens the path
    after = new_job()
    assert create_now(store, after) == [None]
    assert stored_ids(store.path) == {job.id, after.id}


def test_the_log_is_checkpointed_by_a_worker_thread_every_n_commits(
    store: SQLiteJobStore,
) -> None:
    """The connection of calls run now never checkpoints (that syncs the disk): a
    worker thread does, every `checkpoint_every` commits, so the log stays bounded.
    A row is in the database file itself only once a checkpoint copied it there."""
    store.db.checkpoint_every = 5

    def in_database_file(job: Job) -> bool:
        return job.id.encode() in store.path.read_bytes()

    jobs = [new_job() for _ in range(5)]
    for job in jobs[:4]:
        assert create_now(store, job) == [None]
    assert not any(map(in_database_file, jobs[:4])), "the caller's commits checkpointed"
    assert create_now(store, jobs[4]) == [None]  # the fifth: a worker thread checkpoints
    until(lambda: all(map(in_database_file, jobs)), "the worker thread checkpointed the log")


@pytest.mark.process
def test_a_full_disk_fails_a_write_run_now_and_leaves_no_half_write(tmp_path: Path) -> None:
    with tmpfs.mounted(tmp_path / "disk", "2m") as disk:
        store = SQLiteJobStore(disk / "jobs.sqlite3", ttl_s=60.0)
        try:
            held = new_job()
            assert create_now(store, held) == [None]
            filler = tmpfs.fill(disk)
            refused = new_job()
            with pytest.raises(StorageUnavailable):
                for _ in range(200):  # a page's worth of space may be left at first
                    refused = new_job()
                    create_now(store, refused)
            assert refused.id not in stored_ids(store.path)
            tmpfs.free(filler)
            after = new_job()
            assert create_now(store, after) == [None]
            assert {held.id, after.id} <= stored_ids(store.path)
        finally:
            store.close()
