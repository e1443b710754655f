"""The job record and its wire form.

A job is created when a request cannot be answered before its deadline; this
module owns what a job is (`Job`, `JobStatus`, its id and its public object),
not where it is kept (runtime/jobs/store.py).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from runtime.clock import utc_second
from runtime.errors import Cancelled, WorkerLost
from runtime.wire.render import job_error


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


def new_job_id() -> str:
    """192 random bits from the OS CSPRNG, URL-safe."""
    return secrets.token_urlsafe(24)


def rfc3339(epoch_s: float) -> str:
    """`epoch_s` as RFC 3339 UTC with milliseconds, as `datetime.fromtimestamp(epoch_s,
    UTC).isoformat(timespec="milliseconds")` writes it (with Z): rounded to the
    microsecond half to even, then cut to the millisecond."""
    fraction_s, whole_s = math.modf(epoch_s)  # as datetime splits it, then rounds
    whole, micros = int(whole_s), round(fraction_s * 1_000_000)
    if micros >= 1_000_000:
        whole, micros = whole + 1, micros - 1_000_000
    elif micros < 0:
        whole, micros = whole - 1, micros + 1_000_000
    # The second's text is kept (runtime/clock.py): a datetime per call cost a 202
    # and its poll about 6 % of their instructions (issue 29).
    return f"{utc_second(whole)}.{micros // 1000:03d}Z"


@dataclass
class Job:
    id: str
    handler: str
    input: Any
    status: JobStatus = JobStatus.QUEUED
    phase: str = "queued"
    attempts: int = 0
    # Epoch seconds on the instance's `clock.wall()`, set when the job is recorded
    # (by the manager, and again by the store that writes it).
    created_at: float = 0.0
    updated_at: float = 0.0
    expires_at: float = 0.0
    output: Any = None
    error: dict[str, Any] | None = None
    owner: str | None = None
    lease_until: float | None = None
    # Id (not the secret) of the API key that created the job; None when auth is off.
    key_id: str | None = None
    progress: dict[str, Any] | None = None
    # Bytes of its payloads (input, output, error, progress) as its store holds them
    # serialized, where known (a record read or written back; 0 otherwise): what a
    # record costs the memory of finished jobs (runtime/jobs/finished.py), known
    # without serializing anything again. Not part of the record's value.
    payload_bytes: int = field(default=0, compare=False, repr=False)

    def public(self) -> dict[str, Any]:
        """The job object of the HTTP contract."""
        created = rfc3339(self.created_at)
        body: dict[str, Any] = {
            "id": self.id,
            "handler": self.handler,
            "status": str(self.status),
            "phase": self.phase,
            "attempts": self.attempts,
            "created_at": created,
            # A job just created (every 202) has not been updated since.
            "updated_at": (
                created if self.updated_at == self.created_at else rfc3339(self.updated_at)
            ),
        }
        if self.progress:
            body["progress"] = self.progress
        if self.status is JobStatus.SUCCEEDED:
            body["output"] = self.output
        if self.error is not None:
            body["error"] = self.error
        return body


def lost_error(max_attempts: int) -> dict[str, Any]:
    """The error of a job whose instance stopped once too often (written by a store)."""
    stopped = f"the instance running this job stopped; gave up after {max_attempts} attempts"
    return job_error(WorkerLost(stopped))


def cancelled_error() -> dict[str, Any]:
    """The error of a job its client cancelled (written by a store)."""
    return job_error(Cancelled("cancelled by the client"))


# What a client is told to wait (Retry-After) before retrying a request the job
# store refused: long enough not to hammer a full disk, short enough to notice
# that it was freed.
STORE_RETRY_AFTER_S = 5.0
