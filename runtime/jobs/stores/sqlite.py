"""Jobs in one SQLite file (WAL), shared safely by several processes.

Every state change is a single conditional UPDATE, so racing instances (the
emulator runs several on one file) never both own a job.

Storage faults are the file's (runtime/jobs/stores/sqlite_file.py): every
sqlite3 or OS error becomes `StorageUnavailable` there, once, and a write is
reported done only once it is in the file that `path` names.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from runtime.clock import SYSTEM, Clock
from runtime.errors import ConfigError, Conflict
from runtime.jobs.job import (
    Job,
    JobStatus,
    cancelled_error,
    lost_error,
)
from runtime.jobs.stores.not_now import NotNow, T
from runtime.jobs.stores.rows import FIELDS, dump, job_of, row_of
from runtime.jobs.stores.sqlite_file import SQLiteFile

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


_INSERT = f"INSERT INTO jobs ({FIELDS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"
# UPDATE ... RETURNING (SQLite 3.35): a write that answers with the row it wrote,
# where older SQLite (Debian 11, Ubuntu 20.04) needs a read after it.
RETURNING = sqlite3.sqlite_version_info >= (3, 35, 0)


class SQLiteJobStore:
    def __init__(
        self, path: Path, *, ttl_s: float, clock: Clock = SYSTEM, returning: bool = RETURNING
    ) -> None:
        self.path = path
        self.ttl_s = ttl_s
        # Whether this SQLite has RETURNING (False also tests the older path).
        self.returning = returning
        # Records hold epoch seconds (other processes read them): the wall clock.
        self.clock = clock
        self.db = SQLiteFile(path, schema=_SCHEMA)

    @classmethod
    def from_url(cls, url: str, *, ttl_s: float, clock: Clock = SYSTEM) -> SQLiteJobStore:
        prefix = "sqlite:///"
        if not url.startswith(prefix) or len(url) == len(prefix):
            raise ConfigError(f"THAW_JOB_STORE={url!r}: expected sqlite:///relative/or//abs/path")
        return cls(Path(url[len(prefix) :]), ttl_s=ttl_s, clock=clock)

    # ---- the contract ------------------------------------------------------------

    def now(self, call: Callable[[], T], *, writes: bool) -> T | NotNow:
        return self.db.now(call, writes=writes)

    def create(self, job: Job) -> None:
        conflict = self.create_many([job])[0]
        if conflict is not None:
            raise conflict

    def create_many(self, jobs: Sequence[Job]) -> list[Conflict | None]:
        """One transaction for all; a used id fails only its own insert."""
        now = self.clock.wall()
        outcomes: list[Conflict | None] = []
        with self.db.transaction("creating jobs") as conn:
            for job in jobs:
                job.created_at = job.updated_at = now
                job.expires_at = now + self.ttl_s
                try:
                    conn.execute(_INSERT, row_of(job))
                except sqlite3.IntegrityError:
                    outcomes.append(Conflict(f"job id {job.id!r} already exists"))
                else:
                    outcomes.append(None)
        return outcomes

    def get(self, job_id: str) -> Job | None:
        rows = self.db.read(
            f"reading job {job_id}",
            f"SELECT {FIELDS} FROM jobs WHERE id = ? AND expires_at > ?",
            (job_id, self.clock.wall()),
        )
        return job_of(rows[0]) if rows else None

    def claim(self, job_id: str, owner: str, lease_s: float, max_attempts: int) -> Job | None:
        now = self.clock.wall()
        claimed = self.db.write(
            f"claiming job {job_id}",
            "UPDATE jobs SET status = 'running', owner = ?, lease_until = ?,"
            " attempts = attempts + 1, phase = 'claimed', updated_at = ?, error = NULL"
            " WHERE id = ? AND attempts < ? AND expires_at > ?"
            " AND (status = 'queued' OR (status = 'running' AND lease_until < ?))",
            (owner, now + lease_s, now, job_id, max_attempts, now, now),
        )
        if claimed == 1:
            return self.get(job_id)
        self.db.write(
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
        claimed = self.db.write(
            f"claiming job {job_id}",
            "UPDATE jobs SET owner = ?, lease_until = ?,"
            " attempts = attempts + 1, phase = 'claimed', updated_at = ?, error = NULL"
            " WHERE id = ? AND owner = ? AND status = 'running' AND attempts < ?"
            " AND expires_at > ?",
            (owner, now + lease_s, now, job_id, dead_owner, max_attempts, now),
        )
        if claimed == 1:
            return self.get(job_id)
        self.db.write(
            f"failing job {job_id}",
            "UPDATE jobs SET status = 'failed', phase = 'failed', error = ?, owner = NULL,"
            " updated_at = ? WHERE id = ? AND owner = ? AND status = 'running'"
            " AND attempts >= ?",
            (orjson.dumps(lost_error(max_attempts)), now, job_id, dead_owner, max_attempts),
        )
        return None

    def owned(self, owner: str, limit: int = 100) -> list[str]:
        rows = self.db.read(
            "listing jobs by owner",
            "SELECT id FROM jobs WHERE owner = ? AND status = 'running' AND expires_at > ?"
            " ORDER BY created_at LIMIT ?",
            (owner, self.clock.wall(), limit),
        )
        return [row[0] for row in rows]

    def ping(self, owner: str) -> None:
        self.db.write(
            "writing a probe",
            "INSERT OR REPLACE INTO probes (id, owner, at) VALUES (1, ?, ?)",
            (owner, self.clock.wall()),
        )

    def heartbeat(
        self, job_id: str, owner: str, lease_s: float, *, attempt: int | None = None
    ) -> bool:
        now = self.clock.wall()
        changed = self.db.write(
            f"renewing the lease of job {job_id}",
            "UPDATE jobs SET lease_until = ?, expires_at = MAX(expires_at, ?)"
            " WHERE id = ? AND owner = ? AND status = 'running'" + _fence(attempt),
            (now + lease_s, now + self.ttl_s, job_id, owner, *_attempt(attempt)),
        )
        return changed == 1

    def set_phase(
        self,
        job_id: str,
        owner: str,
        phase: str,
        progress: dict[str, Any] | None = None,
        *,
        attempt: int | None = None,
    ) -> bool:
        changed = self.db.write(
            f"updating job {job_id}",
            "UPDATE jobs SET phase = ?, progress = ?, updated_at = ?"
            " WHERE id = ? AND owner = ? AND status = 'running'" + _fence(attempt),
            (phase, dump(progress), self.clock.wall(), job_id, owner, *_attempt(attempt)),
        )
        return changed == 1

    def finish(
        self,
        job_id: str,
        owner: str,
        status: JobStatus,
        output: Any = None,
        error: dict[str, Any] | None = None,
        *,
        attempt: int | None = None,
    ) -> Job | None:
        if not status.final:
            raise ValueError(f"finish() needs a final status, got {status}")
        now = self.clock.wall()
        sql = (
            "UPDATE jobs SET status = ?, phase = ?, output = ?, error = ?, lease_until = NULL,"
            " progress = NULL, updated_at = ?, expires_at = ?"
            " WHERE id = ? AND owner = ? AND status = 'running'" + _fence(attempt)
        )
        params = (
            str(status),
            str(status),
            dump(output),
            dump(error),
            now,
            now + self.ttl_s,
            job_id,
            owner,
            *_attempt(attempt),
        )
        what = f"recording the outcome of job {job_id}"
        if self.returning:
            rows = self.db.write_rows(what, f"{sql} RETURNING {FIELDS}", params)
            return job_of(rows[0]) if rows else None
        # A final record changes no more: the read finds it as written.
        return self.get(job_id) if self.db.write(what, sql, params) == 1 else None

    def cancel(self, job_id: str) -> Job | None:
        error = orjson.dumps(cancelled_error())
        self.db.write(
            f"cancelling job {job_id}",
            "UPDATE jobs SET status = 'cancelled', phase = 'cancelled', error = ?, output = NULL,"
            " updated_at = ? WHERE id = ? AND status IN ('queued', 'running')",
            (error, self.clock.wall(), job_id),
        )
        return self.get(job_id)

    def lapsed(self, limit: int = 100) -> list[str]:
        now = self.clock.wall()
        rows = self.db.read(
            "listing lapsed jobs",
            "SELECT id FROM jobs WHERE expires_at > ? AND (status = 'queued'"
            " OR (status = 'running' AND lease_until < ?)) ORDER BY created_at LIMIT ?",
            (now, now, limit),
        )
        return [row[0] for row in rows]

    def purge_expired(self) -> int:
        return self.db.write(
            "purging expired jobs", "DELETE FROM jobs WHERE expires_at <= ?", (self.clock.wall(),)
        )

    def close(self) -> None:
        self.db.close()


def _fence(attempt: int | None) -> str:
    """With `attempt` (the claim's `attempts`), a write only that run of the job may make."""
    return "" if attempt is None else " AND attempts = ?"


def _attempt(attempt: int | None) -> tuple[int, ...]:
    return () if attempt is None else (attempt,)
