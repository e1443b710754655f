"""The PostgreSQL job store's SQL: its statements and how a row maps to a `Job`.

Kept apart from the store's calls (postgres.py) so each reads as one thing: here
what the claim, fencing and notification look like in SQL; there when each runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from runtime.jobs.job import Job, JobStatus
from runtime.jobs.stores.postgres_listen import CHANNEL

FIELDS = (
    "id, handler, status, phase, attempts, created_at, updated_at, expires_at,"
    " input, output, error, owner, lease_until, key_id, progress"
)
# The same, qualified, where a claim's UPDATE joins the row it locked.
J_FIELDS = ", ".join(f"j.{name.strip()}" for name in FIELDS.split(","))
NOTIFY = f"pg_notify('{CHANNEL}', id || ' ' || status || ' ' || handler)"
# Queued, or running with a lapsed lease, and not expired (SQLite's WHERE clause).
PENDING = (
    "expires_at > %(now)s AND (status = 'queued' OR (status = 'running' AND lease_until < %(now)s))"
)
RUN = (
    "status = 'running', owner = %(owner)s, lease_until = %(lease)s, attempts = j.attempts + 1,"
    " phase = 'claimed', updated_at = %(now)s, error = NULL"
)
LOSE = "status = 'failed', phase = 'failed', error = %(lost)s, owner = NULL, updated_at = %(now)s"


def claim_sql(target: str) -> str:
    """A claim of the row `target` selects (locked, SKIP LOCKED): run it, or fail it as
    lost when out of attempts; the row comes back, first column true for a claim."""
    return (
        f"WITH target AS ({target} FOR UPDATE SKIP LOCKED),"
        f" won AS (UPDATE thaw_jobs j SET {RUN} FROM target"
        f" WHERE j.id = target.id AND j.attempts < %(max)s RETURNING {J_FIELDS}),"
        f" lost AS (UPDATE thaw_jobs j SET {LOSE} FROM target"
        " WHERE j.id = target.id AND j.status = 'running' AND j.attempts >= %(max)s"
        f" RETURNING {J_FIELDS})"
        f" SELECT true, {FIELDS}, {NOTIFY} FROM won"
        f" UNION ALL SELECT false, {FIELDS}, {NOTIFY} FROM lost"
    )


CLAIM = claim_sql(
    f"SELECT id FROM thaw_jobs WHERE id = %(id)s AND (attempts < %(max)s OR status = 'running')"
    f" AND {PENDING}"
)
CLAIM_ORPHAN = claim_sql(
    "SELECT id FROM thaw_jobs WHERE id = %(id)s AND owner = %(dead)s AND status = 'running'"
    " AND expires_at > %(now)s"
)
# A queued job is never lost, so the next one's claim is a single UPDATE with
# no failing branch: less to plan on every claim when nothing is prepared.
CLAIM_NEXT = (
    f"UPDATE thaw_jobs j SET {RUN} FROM (SELECT id FROM thaw_jobs WHERE status = 'queued'"
    " AND expires_at > %(now)s AND attempts < %(max)s{handlers} ORDER BY created_at LIMIT 1"
    f" FOR UPDATE SKIP LOCKED) target WHERE j.id = target.id RETURNING true, {J_FIELDS},"
    f" pg_notify('{CHANNEL}', j.id || ' ' || j.status || ' ' || j.handler)"
)


def dump(value: Any) -> bytes | None:
    return None if value is None else orjson.dumps(value)


def load(blob: bytes | None) -> Any:
    return None if blob is None else orjson.loads(blob)


def job_of(row: Sequence[Any]) -> Job:
    return Job(
        id=row[0],
        handler=row[1],
        status=JobStatus(row[2]),
        phase=row[3],
        attempts=row[4],
        created_at=row[5],
        updated_at=row[6],
        expires_at=row[7],
        input=load(row[8]),
        output=load(row[9]),
        error=load(row[10]),
        owner=row[11],
        lease_until=row[12],
        key_id=row[13],
        progress=load(row[14]),
    )


ROW = "(" + ", ".join(["%s"] * 15) + ")"


def row_of(job: Job) -> tuple[Any, ...]:
    return (
        job.id,
        job.handler,
        str(job.status),
        job.phase,
        job.attempts,
        job.created_at,
        job.updated_at,
        job.expires_at,
        dump(job.input),
        dump(job.output),
        dump(job.error),
        job.owner,
        job.lease_until,
        job.key_id,
        dump(job.progress),
    )


def fence(attempt: int | None) -> str:
    return "" if attempt is None else " AND attempts = %(attempt)s"
