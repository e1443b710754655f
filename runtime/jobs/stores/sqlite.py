"""Jobs in one SQLite file (WAL), shared safely by several processes.

Every state change is a single conditional UPDATE, so racing instances (the
emulator runs several on one file) never both own a job. Connections are per
thread because callers reach the store from a thread pool.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from runtime.errors import ConfigError, Conflict
from runtime.jobs.job import LOST_ERROR, Job, JobStatus

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
"""

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


class SQLiteJobStore:
    def __init__(self, path: Path, *, ttl_s: float) -> None:
        self.path = path
        self.ttl_s = ttl_s
        path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        # SQLite allows one writer at a time and makes the others sleep in
        # growing steps (up to 100 ms) while they wait. Writers of this process
        # queue on a lock instead, so a job's creation is never stuck behind
        # that back-off; other processes still meet the busy timeout.
        self._write_lock = threading.Lock()
        with self._conn() as conn:
            conn.executescript(_SCHEMA)

    @classmethod
    def from_url(cls, url: str, *, ttl_s: float) -> SQLiteJobStore:
        prefix = "sqlite:///"
        if not url.startswith(prefix) or len(url) == len(prefix):
            raise ConfigError(f"THAW_JOB_STORE={url!r}: expected sqlite:///relative/or//abs/path")
        return cls(Path(url[len(prefix) :]), ttl_s=ttl_s)

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA busy_timeout=30000")
            self._local.conn = conn
        return conn

    def _write(self, sql: str, params: tuple[Any, ...]) -> int:
        with self._write_lock:
            return self._conn().execute(sql, params).rowcount

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
        now = time.time()
        outcomes: list[Conflict | None] = []
        with self._write_lock:
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
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
        return outcomes

    def get(self, job_id: str) -> Job | None:
        row = (
            self._conn()
            .execute(
                f"SELECT {_COLUMNS} FROM jobs WHERE id = ? AND expires_at > ?",
                (job_id, time.time()),
            )
            .fetchone()
        )
        return None if row is None else self._row_to_job(row)

    def claim(self, job_id: str, owner: str, lease_s: float, max_attempts: int) -> Job | None:
        now = time.time()
        claimed = self._write(
            "UPDATE jobs SET status = 'running', owner = ?, lease_until = ?,"
            " attempts = attempts + 1, phase = 'claimed', updated_at = ?, error = NULL"
            " WHERE id = ? AND attempts < ? AND expires_at > ?"
            " AND (status = 'queued' OR (status = 'running' AND lease_until < ?))",
            (owner, now + lease_s, now, job_id, max_attempts, now, now),
        )
        if claimed == 1:
            return self.get(job_id)
        error = orjson.dumps(
            {
                "type": LOST_ERROR,
                "message": (
                    f"the instance running this job stopped; gave up after {max_attempts} attempts"
                ),
            }
        )
        self._write(
            "UPDATE jobs SET status = 'failed', phase = 'failed', error = ?, owner = NULL,"
            " updated_at = ? WHERE id = ? AND status = 'running' AND lease_until < ?"
            " AND attempts >= ?",
            (error, now, job_id, now, max_attempts),
        )
        return None

    def heartbeat(self, job_id: str, owner: str, lease_s: float) -> bool:
        now = time.time()
        changed = self._write(
            "UPDATE jobs SET lease_until = ?, expires_at = MAX(expires_at, ?)"
            " WHERE id = ? AND owner = ? AND status = 'running'",
            (now + lease_s, now + self.ttl_s, job_id, owner),
        )
        return changed == 1

    def set_phase(
        self, job_id: str, owner: str, phase: str, progress: dict[str, Any] | None = None
    ) -> bool:
        changed = self._write(
            "UPDATE jobs SET phase = ?, progress = ?, updated_at = ?"
            " WHERE id = ? AND owner = ? AND status = 'running'",
            (phase, _dump(progress), time.time(), job_id, owner),
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
        now = time.time()
        changed = self._write(
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
        error = orjson.dumps({"type": "cancelled", "message": "cancelled by the client"})
        self._write(
            "UPDATE jobs SET status = 'cancelled', phase = 'cancelled', error = ?, output = NULL,"
            " updated_at = ? WHERE id = ? AND status IN ('queued', 'running')",
            (error, time.time(), job_id),
        )
        return self.get(job_id)

    def lapsed(self, limit: int = 100) -> list[str]:
        now = time.time()
        rows = self._conn().execute(
            "SELECT id FROM jobs WHERE expires_at > ? AND (status = 'queued'"
            " OR (status = 'running' AND lease_until < ?)) ORDER BY created_at LIMIT ?",
            (now, now, limit),
        )
        return [row[0] for row in rows]

    def purge_expired(self) -> int:
        return self._write("DELETE FROM jobs WHERE expires_at <= ?", (time.time(),))

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
