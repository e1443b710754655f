"""One SQLite database file at a path, written only where that path still names it.

Storage faults. Every sqlite3 or OS error becomes `StorageUnavailable` here,
once. A write is reported done only once it is in the file that `path` names:
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
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from runtime.errors import StorageUnavailable
from runtime.jobs.job import STORE_RETRY_AFTER_S

log = logging.getLogger("thaw.jobs")

_MAGIC = b"SQLite format 3\x00"
_SIDE_FILES = ("-wal", "-shm")

# A file as the kernel knows it: (st_dev, st_ino).
Identity = tuple[int, int]


def _identity(path: str | Path) -> Identity | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def _identity_of_fd(fd: int) -> Identity | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _descriptors_of(identity: Identity) -> Iterator[int]:
    """This process's open descriptors on the file `identity` (Linux: /proc); lazily."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        if name.isdigit() and _identity_of_fd(int(name)) == identity:
            yield int(name)


class _Connection(threading.local):
    """One thread's connection and the file it opened."""

    conn: sqlite3.Connection | None = None
    identity: Identity | None = None
    # A descriptor SQLite holds on that file, to read its header (see `_header`).
    fd: int | None = None


class SQLiteFile:
    """The database at `path` (created with `schema`), its per-thread connections, its faults."""

    def __init__(self, path: Path, *, schema: str) -> None:
        self.path = path
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
        # A directory that cannot be made is a start-up error (an OSError that ends
        # the server), as before; faults of the open store are StorageUnavailable.
        path.parent.mkdir(parents=True, exist_ok=True)
        with self.translated("opening the job database"):
            self.connection()

    def write(self, what: str, sql: str, params: tuple[Any, ...]) -> int:
        """One statement that changes the file; its row count once it is durable there."""
        with self.translated(what), self._write_lock:
            count: int = self.connection().execute(sql, params).rowcount
            self.check_durable()
            return count

    def read(self, what: str, sql: str, params: tuple[Any, ...]) -> list[Any]:
        with self.translated(what):
            return self.connection().execute(sql, params).fetchall()

    @contextlib.contextmanager
    def transaction(self, what: str) -> Iterator[sqlite3.Connection]:
        """A write transaction (BEGIN IMMEDIATE ... COMMIT), durable when the block ends."""
        with self.translated(what), self._write_lock:
            conn = self.connection()
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                # A failed COMMIT (a full disk) leaves the transaction open; a
                # failed statement may have rolled it back already.
                if conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                raise
            self.check_durable()

    def close(self) -> None:
        self._drop()

    @contextlib.contextmanager
    def translated(self, what: str) -> Iterator[None]:
        """sqlite3 and OS errors -> StorageUnavailable, once, at the store's boundary."""
        try:
            yield
        except (sqlite3.ProgrammingError, sqlite3.InterfaceError):
            raise  # misuse of the API: a bug here, not the storage
        except (sqlite3.Error, OSError) as exc:
            if isinstance(exc, sqlite3.DatabaseError) and not isinstance(
                exc, sqlite3.OperationalError | sqlite3.IntegrityError
            ):
                # "file is not a database", "malformed": never transient.
                self._mark_broken(f"{exc}")
            raise StorageUnavailable(
                f"job store {self.path}: {what} failed: {exc}", retry_after_s=STORE_RETRY_AFTER_S
            ) from exc

    def connection(self) -> sqlite3.Connection:
        """This thread's connection, reopened first if `path` names another file now.

        A file found broken is refused until it is removed or replaced: writing
        on would mix new records into a damaged file (and closing connections to
        it makes SQLite checkpoint its log into it, which can hide the damage).
        """
        local = self._local
        current = _identity(self.path)
        broken = self._broken
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
        return local.conn

    def _log_replaced(self) -> None:
        log.warning(
            "job database %s was deleted or replaced while open: now using the"
            " file at that path; jobs recorded only in the old file are lost",
            self.path,
        )

    def _mark_broken(self, detail: str) -> None:
        identity = self._local.identity or _identity(self.path)
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
                    identity = _identity(self.path)
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
                self._sides = {s: _identity(f"{self.path}{s}") for s in _SIDE_FILES}
        finally:
            os.close(directory)  # drops the flock
        return conn, identity

    def _remove_stale_side_files(self) -> None:
        """Remove the -wal/-shm of a database that is no longer at `path` (lock held)."""
        current = _identity(self.path)
        if current is not None and current == self._opened:
            return
        for suffix in _SIDE_FILES:
            side = Path(f"{self.path}{suffix}")
            found = _identity(side)
            # Without a database every side file is an orphan; beside a replacement,
            # only the ones the old database had (the new one's may be in use).
            if found is not None and (current is None or found == self._sides.get(suffix)):
                side.unlink(missing_ok=True)

    def check_durable(self) -> None:
        """Raise unless this thread's last write went to the intact file at `path`.

        Run after every write, before it is reported done: the check before the
        write (`connection`) cannot see a deletion that happens during it.
        """
        expected = self._local.identity
        if _identity(self.path) != expected:
            # The next call notices it too, logs it and reopens.
            raise StorageUnavailable(
                f"job store {self.path}: the database was deleted or replaced while open;"
                " the write went to the old file",
                retry_after_s=STORE_RETRY_AFTER_S,
            )
        head = self._header(expected)
        if head is not None and head != _MAGIC:
            self._mark_broken("overwritten: it no longer starts with SQLite's header")
            raise StorageUnavailable(
                f"job store {self.path}: the database file was overwritten"
                " (it no longer starts with SQLite's header)",
                retry_after_s=STORE_RETRY_AFTER_S,
            )

    def _header(self, identity: Identity | None) -> bytes | None:
        """The first bytes of the database file, read through a descriptor SQLite
        already holds on it; None where there is no way to tell.

        Never through a descriptor of our own: closing any descriptor of a file
        drops every POSIX lock this process holds on it, SQLite's included (the
        lock that tells other processes this database is in use). Without it, the
        last other connection to close deletes the -wal still being written here.
        """
        if identity is None:
            return None
        local = self._local
        known = [] if local.fd is None else [local.fd]
        for fd in itertools.chain(known, _descriptors_of(identity)):  # scans only on a miss
            if _identity_of_fd(fd) != identity:
                continue
            head = os.pread(fd, len(_MAGIC), 0)
            if _identity_of_fd(fd) == identity:  # not closed and reused meanwhile
                local.fd = fd
                return head
        local.fd = None
        return None
