"""One SQLite database file at a path, written only where that path still names it.

Storage faults. Every sqlite3 or OS error becomes `StorageUnavailable` here,
once (through runtime/jobs/stores/sqlite_transaction.py, which also holds a call's
write transaction). A write is reported done only once it is in the file that `path` names:
SQLite keeps writing happily into a database deleted or replaced under an open
connection (the old inode lives on until the connection closes), so a job
"recorded" there is gone at the next restart. After each write the store checks
that `path` still names the file the connection opened (device and inode) and
that the file still starts with SQLite's header (an in-place overwrite keeps
the inode); if not, the write is refused. Before each call a connection whose
file is no longer at `path` is reopened on the file now there: a new, empty one
if the old was deleted. The -wal and -shm files of a deleted or replaced
database are removed before the new one is opened, as SQLite would otherwise
replay the old log into the new file. A file found damaged (overwritten in
place, "not a database", "malformed") is refused until it is removed or replaced.

Connections are per thread because callers reach the store from a thread pool.

A call may also run at once on the event loop (`now`, runtime/jobs/store.py),
on one more connection kept for it, when nothing can make it wait: this
process's write lock is free, SQLite's is taken at once (its busy timeout there
is 0: another process writing means NOT_NOW, not a sleep), the connection is
on the file now at the path, and it is open already (opening takes a lock on
the directory, so worker threads open it, beside their own). A write run now is
one transaction, BEGIN IMMEDIATE to COMMIT, checked as every write is. WAL mode
without fsync on commit (synchronous=NORMAL) makes such a commit a write to
the page cache: tens of microseconds, where the thread hop it saves costs two
wake-ups. The one slow part of a commit, the checkpoint that copies the log
into the database and syncs both, is left to a thread: that connection never
checkpoints itself, and every CHECKPOINT_EVERY commits a worker thread does.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from runtime.errors import StorageUnavailable
from runtime.jobs.job import STORE_RETRY_AFTER_S
from runtime.jobs.stores.not_now import NOT_NOW, NotNow, T
from runtime.jobs.stores.sqlite_identity import MAGIC, Identity, header_of, identity_of
from runtime.jobs.stores.sqlite_transaction import Committed, InCallNow, Translated, Wait

log = logging.getLogger("thaw.jobs")

_SIDE_FILES = ("-wal", "-shm")


class _Held:
    """A connection and the file it opened."""

    conn: sqlite3.Connection | None = None
    identity: Identity | None = None
    # A descriptor SQLite holds on that file, to read its header (see `sqlite_identity.header_of`).
    fd: int | None = None


class _Connection(_Held, threading.local):
    """One thread's connection; `now`: the thread is running a call now (its calls use
    the store's connection for those, `SQLiteFile._now`)."""

    now: bool = False


# Commits made now between two checkpoints run by a worker thread.
CHECKPOINT_EVERY = 256


class SQLiteFile:
    """The database at `path` (created with `schema`), its per-thread connections, its faults."""

    def __init__(self, path: Path, *, schema: str) -> None:
        self.path = path
        # `path` as os.stat takes it at once (a Path converts itself on every call).
        self._where = os.fspath(path)
        self.schema = schema
        self._local = _Connection()
        # SQLite allows one writer at a time and makes the others sleep in
        # growing steps (up to 100 ms) while they wait. Writers of this process
        # queue on a lock instead, so a job's creation is never stuck behind
        # that back-off; other processes still meet the busy timeout.
        self._write_lock = threading.Lock()
        # The database file last opened and its -wal/-shm, store-wide: to log a
        # replacement once (not once per thread), and to know which side files
        # belonged to the old database.
        self._opened_lock = threading.Lock()
        self._opened: Identity | None = None
        self._sides: dict[str, Identity | None] = {}
        # A file found damaged (overwritten, corrupt), and why: refused while at the path.
        self._broken: tuple[Identity, str] | None = None
        # The connection of calls run now (opened by a worker thread), and its user.
        self._now = _Held()
        self._now_lock = threading.Lock()
        self._now_commits = 0
        self.checkpoint_every = CHECKPOINT_EVERY
        self._checkpointer: ThreadPoolExecutor | None = None
        # A directory that cannot be made is a start-up error (an OSError that ends
        # the server), as before; faults of the open store are StorageUnavailable.
        path.parent.mkdir(parents=True, exist_ok=True)
        with self.translated("opening the job database"):
            self.connection()

    def write(self, what: str, sql: str, params: tuple[Any, ...]) -> int:
        """One statement that changes the file; its row count once it is durable there."""
        if self._local.now:  # inside the transaction of a call run now, which checks it
            with self.translated(what):
                return self.writing_now().execute(sql, params).rowcount
        with self.translated(what), self._write_lock:
            count: int = self.connection().execute(sql, params).rowcount
            self.check_durable()
            return count

    def write_rows(self, what: str, sql: str, params: tuple[Any, ...]) -> list[Any]:
        """One statement that changes the file and returns rows (RETURNING); its rows
        once it is durable there."""
        if self._local.now:
            with self.translated(what):
                return self.writing_now().execute(sql, params).fetchall()
        with self.translated(what), self._write_lock:
            # Fetching steps the statement to its end: the change is committed then.
            rows = self.connection().execute(sql, params).fetchall()
            self.check_durable()
            return rows

    def read(self, what: str, sql: str, params: tuple[Any, ...]) -> list[Any]:
        with self.translated(what):
            return self.connection().execute(sql, params).fetchall()

    def transaction(self, what: str) -> AbstractContextManager[sqlite3.Connection]:
        """A write transaction (BEGIN IMMEDIATE ... COMMIT), durable when the block ends."""
        if self._local.now:  # a call run now is one transaction already
            return InCallNow(self, what)
        return self._transaction(what)

    @contextlib.contextmanager
    def _transaction(self, what: str) -> Iterator[sqlite3.Connection]:
        with self.translated(what), self._write_lock:
            conn = self.connection()
            with Committed(conn):
                yield conn
            self.check_durable()

    def close(self) -> None:
        self._drop()
        with self._now_lock:
            self._close_now()
        if self._checkpointer is not None:
            self._checkpointer.shutdown(wait=False)

    # ---- calls run now, on the caller's thread ----------------------------------

    def now(self, call: Callable[[], T], *, writes: bool) -> T | NotNow:
        """`call` run on this thread at once, or NOT_NOW with nothing done (see the module).
        Its own faults are StorageUnavailable, as in a thread."""
        if self._now.conn is None or not self._now_lock.acquire(blocking=False):
            return NOT_NOW
        try:
            if writes and not self._write_lock.acquire(blocking=False):
                return NOT_NOW
            local = self._local
            local.now = True
            try:
                return self._run_now(call, writes)
            except Wait:
                return NOT_NOW
            finally:
                local.now = False
                if writes:
                    self._write_lock.release()
        finally:
            self._now_lock.release()

    def _run_now(self, call: Callable[[], T], writes: bool) -> T:
        conn = self.connection()
        if not writes:
            return call()
        # A busy BEGIN is `Wait` (translated): nothing was done.
        with self.translated("writing"), Committed(conn):
            result = call()
        self.check_durable()
        self._now_commits += 1
        if self._now_commits >= self.checkpoint_every:
            self._now_commits = 0
            if self._checkpointer is None:
                self._checkpointer = ThreadPoolExecutor(1, "thaw-sqlite-checkpoint")
            self._checkpointer.submit(self._checkpoint)
        return result

    def writing_now(self) -> sqlite3.Connection:
        conn = self._now.conn
        if conn is None or not conn.in_transaction:  # a call run now as a read writes
            raise Wait()
        return conn

    def _checkpoint(self) -> None:
        """Copy the log into the database (a worker thread's connection), waiting for nobody."""
        try:
            with self.translated("checkpointing"):
                self.connection().execute("PRAGMA wal_checkpoint(PASSIVE)")
        except StorageUnavailable as exc:
            log.debug("job database checkpoint skipped: %s", exc.message)

    def _open_now(self, identity: Identity) -> None:
        """On a worker thread whose connection is on the file `identity`: the connection of
        calls run now, (re)opened on that file unless it is on it, or in use."""
        if self._now.identity == identity or not self._now_lock.acquire(blocking=False):
            return
        try:
            self._close_now()
            conn = sqlite3.connect(
                self.path, timeout=0.0, isolation_level=None, check_same_thread=False
            )
            try:
                conn.execute("PRAGMA synchronous=NORMAL")
                conn.execute("PRAGMA busy_timeout=0")
                conn.execute("PRAGMA wal_autocheckpoint=0")
                if identity_of(self.path) != identity:
                    raise FileNotFoundError(f"{self.path} changed while being opened")
            except BaseException:
                conn.close()
                raise
            self._now.conn, self._now.identity, self._now.fd = conn, identity, None
        except (sqlite3.Error, OSError) as exc:
            log.debug("no connection for calls run now: %s", exc)
        finally:
            self._now_lock.release()

    def _close_now(self) -> None:
        conn, self._now.conn, self._now.identity, self._now.fd = self._now.conn, None, None, None
        if conn is not None:
            with contextlib.suppress(sqlite3.Error):
                conn.close()

    def calling_now(self) -> bool:
        return self._local.now

    def translated(self, what: str) -> Translated:
        """sqlite3 and OS errors -> StorageUnavailable, once, at the store's boundary."""
        return Translated(self, what)

    def unavailable(self, what: str, exc: sqlite3.Error | OSError) -> StorageUnavailable:
        if isinstance(exc, sqlite3.DatabaseError) and not isinstance(
            exc, sqlite3.OperationalError | sqlite3.IntegrityError
        ):
            # "file is not a database", "malformed": never transient.
            self._mark_broken(f"{exc}")
        return StorageUnavailable(
            f"job store {self.path}: {what} failed: {exc}", retry_after_s=STORE_RETRY_AFTER_S
        )

    def connection(self) -> sqlite3.Connection:
        """This thread's connection, reopened first if `path` names another file now.

        A file found broken is refused until it is removed or replaced: writing
        on would mix new records into a damaged file (and closing connections to
        it makes SQLite checkpoint its log into it, which can hide the damage).
        """
        local = self._local
        current = identity_of(self._where)
        broken = self._broken
        if local.now:
            # Reopening (and saying why) is for a thread: a call run now never waits.
            if self._now.conn is None or self._now.identity != current or broken is not None:
                raise Wait()
            return self._now.conn
        if broken is not None:
            if current == broken[0]:
                raise StorageUnavailable(
                    f"job store {self.path}: the database file is damaged ({broken[1]});"
                    " refused until it is removed or replaced",
                    retry_after_s=STORE_RETRY_AFTER_S,
                )
            with self._opened_lock:
                if self._broken is broken:
                    self._broken = None
        if local.conn is not None and local.identity != current:
            with self._opened_lock:
                # The first thread to notice logs it (each then reopens its own);
                # a thread with no connection yet may open the new file first, and
                # `_connect` logs it then.
                if self._opened is not None and self._opened == local.identity:
                    self._opened = None
                    self._log_replaced()
            self._drop()
        if local.conn is None:
            local.conn, local.identity = self._connect()
        if self._now.identity != local.identity and local.identity is not None:
            self._open_now(local.identity)
        return local.conn

    def _log_replaced(self) -> None:
        log.warning(
            "job database %s was deleted or replaced while open: now using the"
            " file at that path; jobs recorded only in the old file are lost",
            self.path,
        )

    def _mark_broken(self, detail: str) -> None:
        identity = self._local.identity or identity_of(self.path)
        if identity is None:
            return
        with self._opened_lock:
            if self._broken is None or self._broken[0] != identity:
                self._broken = (identity, detail)
                log.error("job database %s is damaged: %s", self.path, detail)

    def _drop(self) -> None:
        conn, self._local.conn, self._local.identity = self._local.conn, None, None
        self._local.fd = None
        if conn is not None:
            with contextlib.suppress(sqlite3.Error):
                conn.close()

    def _connect(self) -> tuple[sqlite3.Connection, Identity]:
        """A connection to the file now at `path`, and that file's identity.

        Under an exclusive lock on the directory, so that the processes sharing
        the database agree on which side files are stale: the first to see the
        database deleted or replaced removes the old -wal/-shm before creating or
        opening the new file; the others find the new ones and keep them.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            with contextlib.suppress(OSError):  # no flock here: proceed unlocked
                fcntl.flock(directory, fcntl.LOCK_EX)
            with self._opened_lock:
                self._remove_stale_side_files()
                conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
                try:
                    conn.execute("PRAGMA journal_mode=WAL")
                    conn.execute("PRAGMA synchronous=NORMAL")
                    conn.execute("PRAGMA busy_timeout=30000")
                    conn.executescript(self.schema)
                    identity = identity_of(self.path)
                    if identity is None:
                        raise FileNotFoundError(f"{self.path} vanished while being opened")
                except BaseException:
                    conn.close()
                    raise
                if self._opened is not None and self._opened != identity:
                    self._log_replaced()
                # The side files now at the path are this database's (SQLite
                # recreates them when the last connection of all closes).
                self._opened = identity
                self._sides = {s: identity_of(f"{self.path}{s}") for s in _SIDE_FILES}
        finally:
            os.close(directory)  # drops the flock
        return conn, identity

    def _remove_stale_side_files(self) -> None:
        """Remove the -wal/-shm of a database that is no longer at `path` (lock held)."""
        current = identity_of(self.path)
        if current is not None and current == self._opened:
            return
        for suffix in _SIDE_FILES:
            side = Path(f"{self.path}{suffix}")
            found = identity_of(side)
            # Without a database every side file is an orphan; beside a replacement,
            # only the ones the old database had (the new one's may be in use).
            if found is not None and (current is None or found == self._sides.get(suffix)):
                side.unlink(missing_ok=True)

    def check_durable(self) -> None:
        """Raise unless this thread's last write went to the intact file at `path`.

        Run after every write, before it is reported done: the check before the
        write (`connection`) cannot see a deletion that happens during it.
        """
        held = self._held()
        expected = held.identity
        if identity_of(self._where) != expected:
            # The next call notices it too, logs it and reopens.
            raise StorageUnavailable(
                f"job store {self.path}: the database was deleted or replaced while open;"
                " the write went to the old file",
                retry_after_s=STORE_RETRY_AFTER_S,
            )
        head, held.fd = header_of(expected, held.fd)
        if head is not None and head != MAGIC:
            self._mark_broken("overwritten: it no longer starts with SQLite's header")
            raise StorageUnavailable(
                f"job store {self.path}: the database file was overwritten"
                " (it no longer starts with SQLite's header)",
                retry_after_s=STORE_RETRY_AFTER_S,
            )

    def _held(self) -> _Held:
        """The connection this thread's calls use: its own, or the one of calls run now."""
        return self._now if self._local.now else self._local
