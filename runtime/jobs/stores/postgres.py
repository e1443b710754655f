"""Jobs in PostgreSQL, shared by a fleet of instances (`THAW_JOB_STORE=postgresql://…`).

Same contract as the SQLite and DynamoDB stores; how it maps here:

- Every call is one SQL statement in autocommit: one round trip and one
  transaction, through a pooler in transaction mode too (postgres_pool.py).
  A write that wakes others carries its `pg_notify` in the same statement, so
  the notification goes out exactly when the write commits (postgres_listen.py).
- A claim first locks its row with `FOR UPDATE SKIP LOCKED`: a claimer never
  waits on another; if the row is locked, the claim returns None, as a lost
  race does, and the caller tries again later. `claim_next` takes the oldest
  queued job the same way, so idle instances share a queue without queueing
  on each other's locks.
- Fencing. Each claim adds one to `attempts`, which is the job's fencing
  token: `heartbeat`, `set_phase` and `finish` succeed only while the caller's
  owner still holds the running job and, when it passes `attempt=` (the
  attempts of the Job its claim returned), only for that very run. A late write
  of a presumed-dead owner, or of an earlier run of this one, changes nothing.
- A streaming job's items (`append_items`, `items_after`) live in a table of
  their own, per run, written by that run only and deleted with the job's row
  (runtime/jobs/items.py says who writes and reads them).
- Times (`created_at`, leases, expiry) are epoch seconds from the instance's
  `Clock.wall()`, sent as parameters; the server's `now()` is never used, so
  every instance's reading of a lease is its own clock's, as with SQLite, and
  tests drive them with a ManualClock.
- Opening never fails for an unreachable server: the schema (postgres_schema.py)
  is created or checked at once if the server answers, else by the first call
  that reaches it; until then calls raise `StorageUnavailable`, and the store
  recovers by itself when the server is back. A schema newer than this Thaw's
  is a `ConfigError`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import orjson
import psycopg

from runtime.clock import SYSTEM, Clock
from runtime.errors import ConfigError, Conflict, StorageUnavailable
from runtime.jobs.job import Job, JobStatus, cancelled_error, lost_error
from runtime.jobs.stores.not_now import NOT_NOW, NotNow, T
from runtime.jobs.stores.postgres_listen import JobEvent, Listener
from runtime.jobs.stores.postgres_pool import Pool, Target, parse_url, translated
from runtime.jobs.stores.postgres_schema import ensure_schema
from runtime.jobs.stores.postgres_sql import (
    APPEND_ITEMS,
    CLAIM,
    CLAIM_NEXT,
    CLAIM_ORPHAN,
    ITEMS_AFTER,
    NOTIFY,
    PENDING,
    QUEUE_FIGURES,
    ROW,
    SILENT_OWNERS,
    fence,
)
from runtime.jobs.stores.rows import FIELDS, dump, job_of, row_of

log = logging.getLogger("thaw.jobs")


class PostgresJobStore:
    def __init__(self, dsn: str, *, ttl_s: float, clock: Clock = SYSTEM) -> None:
        self.target: Target = parse_url(dsn)
        self.where = self.target.where
        self.ttl_s = ttl_s
        self.clock = clock
        self._pool = Pool(
            self.target.conninfo, self.target.pool_max, self.where, prepare=self.target.prepare
        )
        self._schema_lock = threading.Lock()
        self._schema_ready = False
        self._listeners: list[Listener] = []
        try:
            self._ensure_schema()
        except StorageUnavailable as exc:
            # Not fatal: /healthz serves meanwhile, and the first call that reaches
            # the server creates or checks the schema (and answers 503 until then).
            log.warning("%s; the job store will retry on its next call", exc)
        except BaseException:
            self._pool.close()
            raise

    @classmethod
    def from_url(cls, url: str, *, ttl_s: float, clock: Clock = SYSTEM) -> PostgresJobStore:
        return cls(url, ttl_s=ttl_s, clock=clock)

    # ---- connections and schema -----------------------------------------------

    def _ensure_schema(self) -> None:
        with self._schema_lock:
            if self._schema_ready:
                return
            try:
                with (
                    translated(self.where, "creating or checking the schema"),
                    self._pool.connection() as conn,
                ):
                    found = ensure_schema(conn, self.where, self.clock.wall())
            except psycopg.ProgrammingError as exc:
                # A role that may not create tables, or one that cannot read them:
                # a deployment's mistake that no retry fixes.
                raise ConfigError(
                    f"job store {self.where}: cannot create or check its tables: {exc}"
                ) from exc
            if found == 0:
                log.info("job store %s: tables created", self.where)
            self._schema_ready = True

    def _rows(
        self, what: str, sql: str, params: dict[str, Any] | Sequence[Any]
    ) -> list[tuple[Any, ...]]:
        """Run one statement; its rows (none for a statement that returns none)."""
        if not self._schema_ready:
            self._ensure_schema()
        with translated(self.where, what), self._pool.connection() as conn:
            cursor = conn.execute(sql, params)
            return cursor.fetchall() if cursor.description is not None else []

    def _count(self, what: str, sql: str, params: dict[str, Any]) -> int:
        if not self._schema_ready:
            self._ensure_schema()
        with translated(self.where, what), self._pool.connection() as conn:
            return conn.execute(sql, params).rowcount

    # ---- the contract ---------------------------------------------------------------

    def create(self, job: Job) -> None:
        conflict = self.create_many([job])[0]
        if conflict is not None:
            raise conflict

    def create_many(self, jobs: Sequence[Job]) -> list[Conflict | None]:
        """One statement for all; a used id (or one repeated in `jobs`) fails only its own."""
        if not jobs:
            return []
        now = self.clock.wall()
        params: list[Any] = []
        for job in jobs:
            job.created_at = job.updated_at = now
            job.expires_at = now + self.ttl_s
            params += row_of(job)
        rows = self._rows(
            "creating jobs",
            f"WITH made AS (INSERT INTO thaw_jobs ({FIELDS}) VALUES"
            f" {', '.join([ROW] * len(jobs))} ON CONFLICT (id) DO NOTHING"
            f" RETURNING id, status, handler) SELECT id, {NOTIFY} FROM made",
            params,
        )
        made = {row[0] for row in rows}
        outcomes: list[Conflict | None] = []
        for job in jobs:
            if job.id in made:
                made.discard(job.id)
                outcomes.append(None)
            else:
                outcomes.append(Conflict(f"job id {job.id!r} already exists"))
        return outcomes

    def get(self, job_id: str) -> Job | None:
        rows = self._rows(
            f"reading job {job_id}",
            f"SELECT {FIELDS} FROM thaw_jobs WHERE id = %(id)s AND expires_at > %(now)s",
            {"id": job_id, "now": self.clock.wall()},
        )
        return job_of(rows[0]) if rows else None

    def _claim(self, what: str, sql: str, params: dict[str, Any], lease_s: float) -> Job | None:
        now = self.clock.wall()
        params.update(now=now, lease=now + lease_s, lost=orjson.dumps(lost_error(params["max"])))
        rows = self._rows(what, sql, params)
        if rows and rows[0][0]:
            return job_of(rows[0][1:])
        return None

    def claim(self, job_id: str, owner: str, lease_s: float, max_attempts: int) -> Job | None:
        return self._claim(
            f"claiming job {job_id}",
            CLAIM,
            {"id": job_id, "owner": owner, "max": max_attempts},
            lease_s,
        )

    def claim_orphan(
        self, job_id: str, dead_owner: str, owner: str, lease_s: float, max_attempts: int
    ) -> Job | None:
        return self._claim(
            f"claiming job {job_id}",
            CLAIM_ORPHAN,
            {"id": job_id, "dead": dead_owner, "owner": owner, "max": max_attempts},
            lease_s,
        )

    def claim_next(
        self,
        owner: str,
        lease_s: float,
        max_attempts: int,
        handlers: Sequence[str] | None = None,
        *,
        queued_before: float | None = None,
    ) -> Job | None:
        """Take the oldest queued job (of one of `handlers`, when given; created before
        `queued_before`, epoch s, when given) to run it.

        Beyond the JobStore contract: how an idle instance takes work another
        accepted. Rows other claimers hold are skipped, never waited for.
        """
        params: dict[str, Any] = {"owner": owner, "max": max_attempts}
        where = ""
        if handlers is not None:
            params["handlers"] = list(handlers)
            where = " AND handler = ANY(%(handlers)s)"
        if queued_before is not None:
            params["before"] = queued_before
            where += " AND created_at < %(before)s"
        return self._claim(
            "claiming a queued job", CLAIM_NEXT.format(handlers=where), params, lease_s
        )

    def owned(self, owner: str, limit: int = 100) -> list[str]:
        rows = self._rows(
            "listing jobs by owner",
            "SELECT id FROM thaw_jobs WHERE owner = %(owner)s AND status = 'running'"
            " AND expires_at > %(now)s ORDER BY created_at LIMIT %(limit)s",
            {"owner": owner, "now": self.clock.wall(), "limit": limit},
        )
        return [row[0] for row in rows]

    def ping(self, owner: str) -> None:
        self._count(
            "writing a probe",
            "INSERT INTO thaw_owners (owner, seen_at) VALUES (%(owner)s, %(now)s)"
            " ON CONFLICT (owner) DO UPDATE SET seen_at = EXCLUDED.seen_at",
            {"owner": owner, "now": self.clock.wall()},
        )

    def heartbeat(
        self, job_id: str, owner: str, lease_s: float, *, attempt: int | None = None
    ) -> bool:
        """Renew the lease; with `attempt`, only for that run of the job (fencing)."""
        now = self.clock.wall()
        return (
            self._count(
                f"renewing the lease of job {job_id}",
                "UPDATE thaw_jobs SET lease_until = %(lease)s,"
                " expires_at = GREATEST(expires_at, %(expires)s)"
                " WHERE id = %(id)s AND owner = %(owner)s AND status = 'running'" + fence(attempt),
                {
                    "lease": now + lease_s,
                    "expires": now + self.ttl_s,
                    "id": job_id,
                    "owner": owner,
                    "attempt": attempt,
                },
            )
            == 1
        )

    def set_phase(
        self,
        job_id: str,
        owner: str,
        phase: str,
        progress: dict[str, Any] | None = None,
        *,
        attempt: int | None = None,
    ) -> bool:
        rows = self._rows(
            f"updating job {job_id}",
            "WITH changed AS (UPDATE thaw_jobs SET phase = %(phase)s, progress = %(progress)s,"
            " updated_at = %(now)s WHERE id = %(id)s AND owner = %(owner)s"
            f" AND status = 'running'{fence(attempt)} RETURNING id, status, handler)"
            f" SELECT {NOTIFY} FROM changed",
            {
                "phase": phase,
                "progress": dump(progress),
                "now": self.clock.wall(),
                "id": job_id,
                "owner": owner,
                "attempt": attempt,
            },
        )
        return len(rows) == 1

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
        """Record the final state, only if `owner` (and that `attempt`) holds the running
        job; the record as written, in the same statement (no read after it)."""
        if not status.final:
            raise ValueError(f"finish() needs a final status, got {status}")
        now = self.clock.wall()
        rows = self._rows(
            f"recording the outcome of job {job_id}",
            "WITH done AS (UPDATE thaw_jobs SET status = %(status)s, phase = %(status)s,"
            " output = %(output)s, error = %(error)s, lease_until = NULL, progress = NULL,"
            " updated_at = %(now)s, expires_at = %(expires)s"
            " WHERE id = %(id)s AND owner = %(owner)s AND status = 'running'"
            f"{fence(attempt)} RETURNING {FIELDS})"
            f" SELECT {FIELDS}, {NOTIFY} FROM done",
            {
                "status": str(status),
                "output": dump(output),
                "error": dump(error),
                "now": now,
                "expires": now + self.ttl_s,
                "id": job_id,
                "owner": owner,
                "attempt": attempt,
            },
        )
        return job_of(rows[0]) if rows else None

    def cancel(self, job_id: str) -> Job | None:
        """Queued or running -> cancelled, in one statement that returns the job as it is."""
        rows = self._rows(
            f"cancelling job {job_id}",
            "WITH cancelled AS (UPDATE thaw_jobs SET status = 'cancelled', phase = 'cancelled',"
            " error = %(error)s, output = NULL, updated_at = %(now)s"
            " WHERE id = %(id)s AND status IN ('queued', 'running') AND expires_at > %(now)s"
            f" RETURNING {FIELDS})"
            f" SELECT {FIELDS}, {NOTIFY} FROM cancelled"
            f" UNION ALL SELECT {FIELDS}, NULL FROM thaw_jobs WHERE id = %(id)s"
            " AND expires_at > %(now)s AND NOT EXISTS (SELECT 1 FROM cancelled)",
            {"error": orjson.dumps(cancelled_error()), "now": self.clock.wall(), "id": job_id},
        )
        return job_of(rows[0]) if rows else None

    def lapsed(self, limit: int = 100) -> list[str]:
        rows = self._rows(
            "listing lapsed jobs",
            f"SELECT id FROM thaw_jobs WHERE status IN ('queued', 'running') AND {PENDING}"
            " ORDER BY created_at LIMIT %(limit)s",
            {"now": self.clock.wall(), "limit": limit},
        )
        return [row[0] for row in rows]

    def purge_expired(self, batch: int = 1000) -> int:
        """Delete expired jobs in batches (short transactions, rows others lock skipped),
        and the probes of instances not seen for a TTL; the number of jobs deleted."""
        now = self.clock.wall()
        total = 0
        while True:
            deleted = self._count(
                "purging expired jobs",
                "DELETE FROM thaw_jobs WHERE id IN (SELECT id FROM thaw_jobs"
                " WHERE expires_at <= %(now)s LIMIT %(batch)s FOR UPDATE SKIP LOCKED)",
                {"now": now, "batch": batch},
            )
            total += deleted
            if deleted < batch:
                break
        self._count(
            "purging old probes",
            "DELETE FROM thaw_owners WHERE seen_at < %(before)s",
            {"before": now - self.ttl_s},
        )
        return total

    # ---- beyond the contract: the fleet's figures and liveness ------------------------

    def queue_figures(self) -> dict[str, tuple[int, float]]:
        """Per handler with queued jobs: how many, and the oldest one's `created_at`."""
        rows = self._rows("counting queued jobs", QUEUE_FIGURES, {"now": self.clock.wall()})
        return {handler: (int(count), float(oldest)) for handler, count, oldest in rows}

    def silent_owners(self, before: float, limit: int = 100) -> list[str]:
        """Owners whose last `ping` is older than `before` (epoch s) and that still
        hold running jobs, the longest silent first."""
        rows = self._rows(
            "listing silent owners",
            SILENT_OWNERS,
            {"before": before, "now": self.clock.wall(), "limit": limit},
        )
        return [row[0] for row in rows]

    # ---- beyond the contract: a streaming job's items, for followers anywhere ------------

    def append_items(
        self, job_id: str, owner: str, attempt: int, start: int, items: Sequence[bytes]
    ) -> bool:
        """Add run `attempt`'s items (orjson bytes) from index `start`; False when that
        run no longer holds the job (nothing written)."""
        rows = self._rows(
            f"writing the items of job {job_id}",
            APPEND_ITEMS,
            {"id": job_id, "owner": owner, "attempt": attempt, "start": start, "items": items},
        )
        return len(rows) == 1

    def items_after(self, job_id: str, start: int, limit: int = 1000) -> list[Any]:
        """The items of the job's current run from index `start` on, in order (up to
        the first one not written yet)."""
        rows = self._rows(
            f"reading the items of job {job_id}",
            ITEMS_AFTER,
            {"id": job_id, "start": start, "now": self.clock.wall(), "limit": limit},
        )
        items: list[Any] = []
        for seq, item in rows:
            if seq != start + len(items):
                break
            items.append(orjson.loads(item))
        return items

    # ---- beyond the contract: wake-ups ------------------------------------------------

    def listen(
        self, on_event: Callable[[JobEvent], None], on_gap: Callable[[], None] = lambda: None
    ) -> Listener:
        """Start this instance's listening session (straight to PostgreSQL, the URL's
        `listen=`); `close()` stops it. See postgres_listen.py for the callbacks."""
        listener = Listener(self.target.listen_conninfo, self.where, on_event, on_gap)
        self._listeners.append(listener)
        return listener.start()

    def now(self, call: Callable[[], T], *, writes: bool) -> T | NotNow:
        return NOT_NOW  # over a network: a call may always wait

    def close(self) -> None:
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener.stop()
        self._pool.close()
