"""The PostgreSQL job store's tables, created and versioned by Thaw itself.

`thaw_schema` holds one row: the version of the tables. Opening a store takes
a transaction-scoped advisory lock (so instances starting together migrate
once, and it works through PgBouncer in transaction mode), creates what is
missing, applies each migration past the version found, in order, in that one
transaction, and records the new version. A version newer than this Thaw's is
refused: an older instance must not write rows whose meaning changed under it.

Migrations only ever append: version N's statements turn version N-1's tables
into N's. Changing an applied one would leave databases that ran the old text
different from new ones with the same version.
"""

from __future__ import annotations

from typing import Any

import psycopg

from runtime.errors import ConfigError

# "thaw" as a number: the advisory lock key of schema changes.
_LOCK_KEY = 0x7468_6177

_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        # Version 1. Payloads are orjson bytes, as in SQLite (exact floats, no parse
        # on the server); times are epoch seconds from the instance's clock, so
        # tests drive leases with a ManualClock and float8 returns what was written.
        # fillfactor leaves room on each page so that phase updates (no indexed
        # column changes) can be HOT updates. A queue table churns: vacuum and
        # analyze it after 5% and 2% of its rows changed (not 20% and 10%), so dead
        # rows stay few and the planner knows how many jobs are queued (with a
        # stale count of ~0 it sorted the whole queue for each claim_next).
        """
        CREATE TABLE thaw_jobs (
            id text PRIMARY KEY,
            handler text NOT NULL,
            status text NOT NULL,
            phase text NOT NULL,
            attempts integer NOT NULL,
            created_at double precision NOT NULL,
            updated_at double precision NOT NULL,
            expires_at double precision NOT NULL,
            input bytea,
            output bytea,
            error bytea,
            owner text,
            lease_until double precision,
            key_id text,
            progress bytea
        ) WITH (
            fillfactor = 80,
            autovacuum_vacuum_scale_factor = 0.05,
            autovacuum_analyze_scale_factor = 0.02
        )
        """,
        # lapsed(): queued and running jobs, oldest first; finished ones never read.
        "CREATE INDEX thaw_jobs_active ON thaw_jobs (created_at)"
        " WHERE status IN ('queued', 'running')",
        # claim_next(): the oldest queued job is the first entry (a handler filter
        # skips others' on the way), and the queue depth an autoscaler reads. Keyed
        # by handler first, the oldest of several handlers would need a sort of
        # every queued row: 4 ms a claim with 2000 queued.
        "CREATE INDEX thaw_jobs_queued ON thaw_jobs (created_at) WHERE status = 'queued'",
        "CREATE INDEX thaw_jobs_owner ON thaw_jobs (owner, created_at) WHERE status = 'running'",
        "CREATE INDEX thaw_jobs_expiry ON thaw_jobs (expires_at)",
        # ping(): one row per instance, the last time it could write.
        """
        CREATE TABLE thaw_owners (
            owner text PRIMARY KEY,
            seen_at double precision NOT NULL
        )
        """,
    ),
    (
        # Version 2. A streaming job's items, written by its owner in batches for
        # followers on any instance (append_items / items_after), per run of the
        # job (`attempt`: a run taken over starts its items again). They go with
        # the job's row: a purge deletes them by the cascade, through the key.
        """
        CREATE TABLE thaw_job_items (
            job_id text NOT NULL REFERENCES thaw_jobs (id) ON DELETE CASCADE,
            attempt integer NOT NULL,
            seq integer NOT NULL,
            item bytea NOT NULL,
            PRIMARY KEY (job_id, attempt, seq)
        )
        """,
    ),
)
SCHEMA_VERSION = len(_MIGRATIONS)


def ensure_schema(conn: psycopg.Connection[Any], where: str, now: float) -> int:
    """Create or migrate the tables in one transaction; the version found before."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
        conn.execute(
            "CREATE TABLE IF NOT EXISTS thaw_schema ("
            " id integer PRIMARY KEY CHECK (id = 1),"
            " version integer NOT NULL,"
            " migrated_at double precision NOT NULL)"
        )
        row = conn.execute("SELECT version FROM thaw_schema").fetchone()
        found = 0 if row is None else int(row[0])
        if found > SCHEMA_VERSION:
            raise ConfigError(
                f"job store {where}: its tables are at schema version {found}, newer than this"
                f" Thaw's ({SCHEMA_VERSION}); run a Thaw that knows version {found}, or point"
                " THAW_JOB_STORE at another database"
            )
        for statements in _MIGRATIONS[found:]:
            for statement in statements:
                conn.execute(statement.encode())
        if found < SCHEMA_VERSION:
            conn.execute(
                "INSERT INTO thaw_schema (id, version, migrated_at) VALUES (1, %s, %s)"
                " ON CONFLICT (id) DO UPDATE SET version = EXCLUDED.version,"
                " migrated_at = EXCLUDED.migrated_at",
                (SCHEMA_VERSION, now),
            )
    return found
