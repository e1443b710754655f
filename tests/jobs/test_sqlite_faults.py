"""The SQLite job store under storage faults, on a real file: a full disk, and the
database deleted, replaced or overwritten under open connections.

Every failure is a `StorageUnavailable` (503 storage-unavailable with Retry-After
upstream), and a write is reported done only when it is in the file at the path.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.errors import StorageUnavailable
from runtime.jobs.job import Job, JobStatus, new_job_id
from runtime.jobs.stores.sqlite import SQLiteJobStore
from tests.jobs import tmpfs


def new_job(owner: str = "a") -> Job:
    return Job(
        id=new_job_id(),
        handler="echo",
        input={"x": 1},
        status=JobStatus.RUNNING,
        attempts=1,
        owner=owner,
        lease_until=4e9,
    )


def in_another_thread(fn: object) -> object:
    """Run `fn` in a fresh thread (a fresh connection), return what it returned."""
    box: list[object] = []
    thread = threading.Thread(target=lambda: box.append(fn()))  # type: ignore[operator]
    thread.start()
    thread.join(30)
    return box[0]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with tmpfs.mounted(tmp_path / "disk", "2m") as disk:
        yield disk


def test_a_full_disk_is_storage_unavailable_until_space_is_freed(small_disk: Path) -> None:
    store = SQLiteJobStore(small_disk / "jobs.sqlite3", ttl_s=60.0)
    try:
        held = new_job()
        store.create(held)
        filler = tmpfs.fill(small_disk)

        refused = new_job()
        with pytest.raises(StorageUnavailable) as caught:
            store.create(refused)
        assert caught.value.status == 503 and caught.value.slug == "storage-unavailable"
        assert caught.value.retry_after_s is not None and caught.value.retry_after_s > 0
        assert isinstance(caught.value.__cause__, sqlite3.OperationalError)
        for write in (
            lambda: store.finish(held.id, "a", JobStatus.SUCCEEDED, {"y": 1}),
            lambda: store.heartbeat(held.id, "a", 30.0),
            lambda: store.ping("a"),
        ):
            with pytest.raises(StorageUnavailable):
                write()
        # Reads still work, and show nothing that was refused.
        assert store.get(refused.id) is None
        got = store.get(held.id)
        assert got is not None and got.status is JobStatus.RUNNING

        tmpfs.free(filler)
        store.ping("a")
        assert store.finish(held.id, "a", JobStatus.SUCCEEDED, {"y": 1})
        store.create(refused)
        assert store.get(refused.id) is not None
    finally:
        store.close()


def test_a_directory_that_cannot_be_made_fails_the_open_then_calls_are_503(
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    # At start-up it is a plain OSError (the server exits 1, as for any bad setting).
    with pytest.raises(OSError):
        SQLiteJobStore(blocker / "jobs.sqlite3", ttl_s=60.0)
    # Once open, losing the directory is a storage fault like any other.
    directory = tmp_path / "jobs"
    store = SQLiteJobStore(directory / "jobs.sqlite3", ttl_s=60.0)
    try:
        for name in os.listdir(directory):
            os.unlink(directory / name)
        directory.rmdir()
        directory.write_text("now a file")
        with pytest.raises(StorageUnavailable):
            store.create(new_job())
    finally:
        store.close()


def test_a_deletion_is_logged_once_when_a_thread_with_no_connection_opens_the_new_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The first write after the deletion comes from a thread that never had a
    connection (a new worker thread): it opens the new file, and says so."""
    path = tmp_path / "jobs.sqlite3"
    store = SQLiteJobStore(path, ttl_s=60.0)
    try:
        store.create(new_job())
        os.unlink(path)
        with caplog.at_level(logging.WARNING, logger="thaw.jobs"):
            after = new_job()
            in_another_thread(lambda: store.create(after))
            assert store.get(after.id) is not None  # the first thread reopens as well
        noticed = [r for r in caplog.records if "deleted or replaced" in r.getMessage()]
        assert len(noticed) == 1
    finally:
        store.close()


@pytest.mark.parametrize("side_files_too", [False, True])
def test_a_deleted_database_is_reopened_and_writes_land_in_the_new_file(
    tmp_path: Path, side_files_too: bool, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "jobs.sqlite3"
    store = SQLiteJobStore(path, ttl_s=60.0)
    try:
        before = new_job()
        store.create(before)
        os.unlink(path)
        if side_files_too:  # `rm jobs.sqlite3*`
            for suffix in ("-wal", "-shm"):
                Path(f"{path}{suffix}").unlink(missing_ok=True)

        with caplog.at_level(logging.WARNING, logger="thaw.jobs"):
            after = new_job()
            store.create(after)
            # Another thread (its own connection) reopens too; logged once.
            in_another_thread(lambda: store.get(after.id))
        noticed = [r for r in caplog.records if "deleted or replaced" in r.getMessage()]
        assert len(noticed) == 1
        assert path.exists()
        # The acknowledged write is in the file at the path, seen by a fresh store.
        fresh = SQLiteJobStore(path, ttl_s=60.0)
        try:
            assert fresh.get(after.id) is not None
            assert fresh.get(before.id) is None  # deleted with its file
            assert sqlite3.connect(path).execute("PRAGMA integrity_check").fetchone() == ("ok",)
        finally:
            fresh.close()
    finally:
        store.close()


def test_a_database_replaced_by_another_file_is_followed(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    store = SQLiteJobStore(path, ttl_s=60.0)
    other_path = tmp_path / "other.sqlite3"
    other = SQLiteJobStore(other_path, ttl_s=60.0)
    try:
        kept = new_job()
        store.create(kept)
        restored = new_job()
        other.create(restored)
        other.close()
        for suffix in ("-wal", "-shm"):  # as after a clean shutdown of its writer
            Path(f"{other_path}{suffix}").unlink(missing_ok=True)
        os.replace(other_path, path)  # an operator restores a backup under the running store

        written = new_job()
        store.create(written)
        assert store.get(restored.id) is not None
        assert store.get(kept.id) is None
        check = SQLiteJobStore(path, ttl_s=60.0)
        try:
            assert check.get(written.id) is not None and check.get(restored.id) is not None
        finally:
            check.close()
    finally:
        store.close()


def test_a_database_overwritten_in_place_refuses_writes_until_it_is_removed(
    tmp_path: Path,
) -> None:
    path = tmp_path / "jobs.sqlite3"
    store = SQLiteJobStore(path, ttl_s=60.0)
    try:
        store.create(new_job())
        with open(path, "r+b") as handle:  # same inode, garbage where the header was
            handle.write(os.urandom(8192))

        refused = new_job()
        with pytest.raises(StorageUnavailable) as caught:
            store.create(refused)
        assert "overwritten" in caught.value.message
        # So does a fresh connection (another thread), whatever SQLite makes of the file.
        assert isinstance(in_another_thread(lambda: _raising(lambda: store.ping("a"))), Exception)

        # The operator removes the broken file: the store starts a new, empty one.
        os.unlink(path)
        accepted = new_job()
        store.create(accepted)
        assert store.get(accepted.id) is not None
    finally:
        store.close()


def _raising(fn: object) -> object:
    """What `fn` returns, or the StorageUnavailable it raises (for another thread)."""
    try:
        return fn()  # type: ignore[operator]
    except StorageUnavailable as exc:
        return exc


def test_a_deletion_between_the_check_and_the_write_is_refused(tmp_path: Path) -> None:
    """The check after the write (not only the one before it) decides: a database
    deleted while this thread's connection is open is seen at the write's end."""
    path = tmp_path / "jobs.sqlite3"
    store = SQLiteJobStore(path, ttl_s=60.0)
    try:
        job = new_job()
        store.create(job)
        conn = store.db.connection()  # this thread's connection, opened on the old file
        os.unlink(path)
        # Write through the open connection, as a write racing the deletion does.
        conn.execute("UPDATE jobs SET phase = 'x' WHERE id = ?", (job.id,))
        with pytest.raises(StorageUnavailable, match="deleted or replaced"):
            store.db.check_durable()
    finally:
        store.close()
