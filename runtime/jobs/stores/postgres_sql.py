"""The PostgreSQL job store's SQL: its statements (a row and a `Job`: rows.py).

Kept apart from the store's calls (postgres.py) so each reads as one thing: here
what the claim, fencing and notification look like in SQL; there when each runs.
"""

from __future__ import annotations

from runtime.jobs.stores.postgres_listen import CHANNEL
from runtime.jobs.stores.rows import FIELDS

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


ROW = "(" + ", ".join(["%s"] * 15) + ")"


def fence(attempt: int | None) -> str:
    return "" if attempt is None else " AND attempts = %(attempt)s"


# The fleet's queue per handler, for /metrics (runtime/jobs/fleet_metrics.py): a
# walk of the partial index of queued jobs, however large the table.
QUEUE_FIGURES = (
    "SELECT handler, count(*), min(created_at) FROM thaw_jobs"
    " WHERE status = 'queued' AND expires_at > %(now)s GROUP BY handler"
)
# Owners not seen since `before` that still hold running jobs: the instances the
# fleet's liveness takes to be dead (runtime/jobs/liveness.py).
SILENT_OWNERS = (
    "SELECT o.owner FROM thaw_owners o WHERE o.seen_at < %(before)s AND EXISTS"
    " (SELECT 1 FROM thaw_jobs j WHERE j.owner = o.owner AND j.status = 'running'"
    " AND j.expires_at > %(now)s) ORDER BY o.seen_at LIMIT %(limit)s"
)

# A batch of a run's items, from index `start`, only while that run holds the job
# (fenced as a finish is); one notification per batch. Written again after a lost
# answer, a batch changes nothing (ON CONFLICT). A data-modifying CTE runs whether
# or not the SELECT reads it.
APPEND_ITEMS = (
    "WITH run AS (SELECT id, handler FROM thaw_jobs WHERE id = %(id)s AND owner = %(owner)s"
    " AND status = 'running' AND attempts = %(attempt)s),"
    " added AS (INSERT INTO thaw_job_items (job_id, attempt, seq, item)"
    " SELECT run.id, %(attempt)s, %(start)s + i.n - 1, i.item FROM run,"
    " unnest(%(items)s::bytea[]) WITH ORDINALITY AS i (item, n) ON CONFLICT DO NOTHING)"
    f" SELECT pg_notify('{CHANNEL}', run.id || ' items ' || run.handler) FROM run"
)
# The items of the job's current run from index `start` on, in order.
ITEMS_AFTER = (
    "SELECT i.seq, i.item FROM thaw_job_items i JOIN thaw_jobs j ON j.id = i.job_id"
    " AND i.attempt = j.attempts WHERE i.job_id = %(id)s AND i.seq >= %(start)s"
    " AND j.expires_at > %(now)s ORDER BY i.seq LIMIT %(limit)s"
)
