"""A job as a row of the SQL stores (SQLite, PostgreSQL), and back.

Both tables hold the same fifteen columns in the same order, payloads as
orjson bytes (exact floats, no parse on the server), so one mapping serves both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from runtime.jobs.job import Job, JobStatus

# The columns, in the order `row_of` gives and `job_of` reads them.
FIELDS = (
    "id, handler, status, phase, attempts, created_at, updated_at, expires_at,"
    " input, output, error, owner, lease_until, key_id, progress"
)


def dump(value: Any) -> bytes | None:
    """`value` as orjson bytes; an `orjson.Fragment` (an input or output its caller
    encoded already: runtime/jobs/group_commit.py, leases.py) is written as it is."""
    return None if value is None else orjson.dumps(value)


def load(blob: bytes | None) -> Any:
    return None if blob is None else orjson.loads(blob)


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
        # Not a generator over them: this runs for every record read or written back.
        payload_bytes=len(row[8] or b"")
        + len(row[9] or b"")
        + len(row[10] or b"")
        + len(row[14] or b""),
    )
