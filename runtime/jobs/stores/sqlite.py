"""Jobs in one SQLite file (WAL), shared safely by several processes.

Every state change is a single conditional UPDATE, so racing instances (the
emulator runs several on one file) never both own a job. Connections are per
thread because callers reach the store from a thread pool.

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
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson

from runtime.clock import SYSTEM, Clock
from runtime.errors import ConfigError, Conflict, StorageUnavailable
from runtime.jobs.job import (
    STORE_RETRY_AFTER_S,
    Job,
    JobStatus,
    cancelled_error,
    lost_error,
)

log = logging.getLogger("thaw.jobs")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    handler TEXT NOT NULL,
    status TEXT NOT NULL,
    phase TEXT NOT NULL,
    attempts INTEGER NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    input BLOB,
    output BLOB,
    error BLOB,
    owner TEXT,
    lease_until REAL,
    key_id TEXT,
    progress BLOB
);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs (status, lease_until);
CREATE INDEX IF NOT EXISTS jobs_expiry ON jobs (expires_at);
CREATE TABLE IF NOT EXISTS probes (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    owner TEXT NOT NULL,
    at REAL NOT NULL
);
"""
_MAGIC = b"SQLite format 3\x00"
_SIDE_FILES = ("-wal", "-shm")

# A file as the kernel knows it: (st_dev, st_ino).
Identity = tuple[int, int]

_COLUMNS = (
    "id, handler, status, phase, attempts, created_at, updated_at, expires_at, "
    "input, output, error, owner, lease_until, key_id, progress"
)


_INSERT = f"INSERT INTO jobs ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"


def _row(job: Job) -> tuple[Any, ...]:
    return (
        job.id,
        job.handler,
        str(job.status),
        job.phase,
        job.attempts,
        job.created_at,
        job.updated_at,
        job.expires_at,
        _dump(job.input),
        _dump(job.output),
        _dump(job.error),
        job.owner,
        job.lease_until,
        job.key_id,
        _dump(job.progress),
    )


def _dump(value: Any) -> bytes | None:
    return None if value is None else orjson.dumps(value)


def _load(blob: bytes | None) -> Any:
    return None if blob is None else orjson.loads(blob)


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


class SQLiteJobStore:
    def __init__(self, path: Path, *, ttl_s: float, clock: Clock = SYSTEM) -> None:
        self.path = path
        self.ttl_s = ttl_s
        # Records hold epoch seconds (other processes read them): the wall clock.
        self.clock = clock
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
        with self._translated("opening the job database"):
            self._conn()

    @classmethod
    def from_url(cls, url: str, *, ttl_s: float, clock: Clock = SYSTEM) -> SQLiteJobStore:
        prefix = "sqlite:///"
        if not url.startswith(prefix) or len(url) == len(prefix):
            raise ConfigError(f"THAW_JOB_STORE={url!r}: expected sqlite:///relative/or//abs/path")
        return cls(Path(url[len(prefix) :]), ttl_s=ttl_s, clock=clock)

    # ---- connections and faults ----------------------------------------------

    @contextlib.contextmanager
    def _translated(self, what: str) -> Iterator[None]:
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

    def _conn(self) -> sqlite3.Connection:
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
                    conn.executescript(_SCHEMA)
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

    def _check_durable(self) -> None:
        """Raise unless this thread's last write went to the intact file at `path`.

        Run after every write, before it is reported done: the check before the
        write (`_conn`) cannot see a deletion that happens during it.
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

    def _write(self, what: str, sql: str, params: tuple[Any, ...]) -> int:
        with self._translated(what), self._write_lock:
            count: int = self._conn().execute(sql, params).rowcount
            self._check_durable()
            return count

    def _read(self, what: str, sql: str, params: tuple[Any, ...]) -> list[Any]:
        with self._translated(what):
            return self._conn().execute(sql, params).fetchall()

    # ---- the contract ------------------------------------------------------------

    def _row_to_job(self, row: tuple[Any, ...]) -> Job:
        return Job(
            id=row[0],
            handler=row[1],
            status=JobStatus(row[2]),
            phase=row[3],
            attempts=row[4],
            created_at=row[5],
            updated_at=row[6],
            expires_at=row[7],
            input=_load(row[8]),
            output=_load(row[9]),
            error=_load(row[10]),
            owner=row[11],
            lease_until=row[12],
            key_id=row[13],
            progress=_load(row[14]),
        )

    def create(self, job: Job) -> None:
        conflict = self.create_many([job])[0]
        if conflict is not None:
            raise conflict

    def create_many(self, jobs: Sequence[Job]) -> list[Conflict | None]:
        """One transaction for all; a used id fails only its own insert."""
        now = self.clock.wall()
        outcomes: list[Conflict | None] = []
        with self._translated("creating jobs"), self._write_lock:
            conn = self._conn()
            conn.execute("BEGIN IMMEDIATE")
            try:
                for job in jobs:
                    job.created_at = job.updated_at = now
                    job.expires_at = now + self.ttl_s
                    try:
                        conn.execute(_INSERT, _row(job))
                    except sqlite3.IntegrityError:
                        outcomes.append(Conflict(f"job id {job.id!r} already exists"))
                    else:
                        outcomes.append(None)
                conn.execute("COMMIT")
            except BaseException:
                # A failed COMMIT (a full disk) leaves the transaction open; a
                # failed statement may have rolled it back already.
                if conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                raise
            self._check_durable()
        return outcomes

    def get(self, job_id: str) -> Job | None:
        rows = self._read(
            f"reading job {job_id}",
            f"SELECT {_COLUMNS} FROM jobs WHERE id = ? AND expires_at > ?",
            (job_id, self.clock.wall()),
        )
        return self._row_to_job(rows[0]) if rows else None

    def claim(self, job_id: str, owner: str, lease_s: float, max_attempts: int) -> Job | None:
        now = self.clock.wall()
        claimed = self._write(
            f"claiming job {job_id}",
            "UPDATE jobs SET status = 'running', owner = ?, lease_until = ?,"
            " attempts = attempts + 1, phase = 'claimed', updated_at = ?, error = NULL"
            " WHERE id = ? AND attempts < ? AND expires_at > ?"
            " AND (status = 'queued' OR (status = 'running' AND lease_until < ?))",
            (owner, now + lease_s, now, job_id, max_attempts, now, now),
        )
        if claimed == 1:
            return self.get(job_id)
        self._write(
            f"failing job {job_id}",
            "UPDATE jobs SET status = 'failed', phase = 'failed', error = ?, owner = NULL,"
            " updated_at = ? WHERE id = ? AND status = 'running' AND lease_until < ?"
            " AND attempts >= ?",
            (orjson.dumps(lost_error(max_attempts)), now, job_id, now, max_attempts),
        )
        return None

    def claim_orphan(
        self, job_id: str, dead_owner: str, owner: str, lease_s: float, max_attempts: int
    ) -> Job | None:
        now = self.clock.wall()
        claimed = self._write(
            f"claiming job {job_id}",
            "UPDATE jobs SET owner = ?, lease_until = ?,"
            " attempts = attempts + 1, phase = 'claimed', updated_at = ?, error = NULL"
            " WHERE id = ? AND owner = ? AND status = 'running' AND attempts < ?"
            " AND expires_at > ?",
            (owner, now + lease_s, now, job_id, dead_owner, max_attempts, now),
        )
        if claimed == 1:
            return self.get(job_id)
        self._write(
            f"failing job {job_id}",
            "UPDATE jobs SET status = 'failed', phase = 'failed', error = ?, owner = NULL,"
            " updated_at = ? WHERE id = ? AND owner = ? AND status = 'running'"
            " AND attempts >= ?",
            (orjson.dumps(lost_error(max_attempts)), now, job_id, dead_owner, max_attempts),
        )
        return None

    def owned(self, owner: str, limit: int = 100) -> list[str]:
        rows = self._read(
            "listing jobs by owner",
            "SELECT id FROM jobs WHERE owner = ? AND status = 'running' AND expires_at > ?"
            " ORDER BY created_at LIMIT ?",
            (owner, self.clock.wall(), limit),
        )
        return [row[0] for row in rows]

    def ping(self, owner: str) -> None:
        self._write(
            "writing a probe",
            "INSERT OR REPLACE INTO probes (id, owner, at) VALUES (1, ?, ?)",
            (owner, self.clock.wall()),
        )

    def heartbeat(self, job_id: str, owner: str, lease_s: float) -> bool:
        now = self.clock.wall()
        changed = self._write(
            f"renewing the lease of job {job_id}",
            "UPDATE jobs SET lease_until = ?, expires_at = MAX(expires_at, ?)"
            " WHERE id = ? AND owner = ? AND status = 'running'",
            (now + lease_s, now + self.ttl_s, job_id, owner),
        )
        return changed == 1

    def set_phase(
        self, job_id: str, owner: str, phase: str, progress: dict[str, Any] | None = None
    ) -> bool:
        changed = self._write(
            f"updating job {job_id}",
            "UPDATE jobs SET phase = ?, progress = ?, updated_at = ?"
            " WHERE id = ? AND owner = ? AND status = 'running'",
            (phase, _dump(progress), self.clock.wall(), job_id, owner),
        )
        return changed == 1

    def finish(
        self,
        job_id: str,
        owner: str,
        status: JobStatus,
        output: Any = None,
        error: dict[str, Any] | None = None,
    ) -> bool:
        if not status.final:
            raise ValueError(f"finish() needs a final status, got {status}")
        now = self.clock.wall()
        changed = self._write(
            f"recording the outcome of job {job_id}",
            "UPDATE jobs SET status = ?, phase = ?, output = ?, error = ?, lease_until = NULL,"
            " progress = NULL, updated_at = ?, expires_at = ?"
            " WHERE id = ? AND owner = ? AND status = 'running'",
            (
                str(status),
                str(status),
                _dump(output),
                _dump(error),
                now,
                now + self.ttl_s,
                job_id,
                owner,
            ),
        )
        return changed == 1

    def cancel(self, job_id: str) -> Job | None:
        error = orjson.dumps(cancelled_error())
        self._write(
            f"cancelling job {job_id}",
            "UPDATE jobs SET status = 'cancelled', phase = 'cancelled', error = ?, output = NULL,"
            " updated_at = ? WHERE id = ? AND status IN ('queued', 'running')",
            (error, self.clock.wall(), job_id),
        )
        return self.get(job_id)

    def lapsed(self, limit: int = 100) -> list[str]:
        now = self.clock.wall()
        rows = self._read(
            "listing lapsed jobs",
            "SELECT id FROM jobs WHERE expires_at > ? AND (status = 'queued'"
            " OR (status = 'running' AND lease_until < ?)) ORDER BY created_at LIMIT ?",
            (now, now, limit),
        )
        return [row[0] for row in rows]

    def purge_expired(self) -> int:
        return self._write(
            "purging expired jobs", "DELETE FROM jobs WHERE expires_at <= ?", (self.clock.wall(),)
        )

    def close(self) -> None:
        self._drop()
