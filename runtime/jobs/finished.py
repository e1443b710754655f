"""Finished jobs, remembered: a bounded, expiring memory of final job records.

A job record stops changing once it is final (succeeded, failed, cancelled):
nothing writes it again, and a cancel of a final job returns it as it is. So
a poll of a finished job need not go to the store. That matters for what
clients do after a job ends: poll once more, fetch the result again, several
clients follow one job; on DynamoDB each of those is a billed read and a
round trip. It matters most when the store cannot serve for a while: a result
this instance has seen stays readable (runtime/jobs/manager.py).

`cachetools.TLRUCache` does the bounds: least recently used out first past
either bound below, and each record out at its own `expires_at` (THAW_JOB_TTL_S),
measured on the wall clock the store writes it with, so the memory never
answers for a job the store has expired. The bound is in bytes as well as records:
each record costs its payloads' serialized bytes (`Job.payload_bytes`, known
from the store's own bytes) and a flat `max_bytes // max_jobs` for the rest,
so `max_jobs` small records fill it, and so do a few large ones. A count alone
let 4,096 finished jobs of 1 MB in and out hold about 15 GiB of RSS (their
parsed payloads: a float of 20 JSON bytes is a 24-byte object and a pointer).
A record larger than a sixteenth of the bound is not kept at all, so one large
output does not push out hundreds of small ones: its polls read the store.

A recorded outcome is also counted (`thaw_jobs_total`), its output added to the
job's quota use, and logged in one line (`outcome_recorded`), wherever it was written:
as the job finished, or with the job itself (work that ended before its record).
"""

from __future__ import annotations

import logging
from typing import Any

from cachetools import TLRUCache

from runtime.clock import SYSTEM, Clock
from runtime.jobs.job import Job, JobStatus
from runtime.jobs.quota import JobQuota, json_size
from runtime.telemetry.logs import DEFERRED_LOGS
from runtime.telemetry.metrics import Metrics

log = logging.getLogger("thaw.jobs")

MAX_JOBS = 4096
# Serialized payload bytes the memory holds at most; as Python objects they take
# about twice that, well inside the per-process overhead a container is told to
# leave (docs/configuration.md, "Host memory").
MAX_BYTES = 16 * 1024 * 1024
# The share of the bound a record may take, at most (see the module's docstring).
LARGEST_SHARE = 16


def _expires(_job_id: str, job: Job, now: float) -> float:
    # A record without an expiry (a store that keeps jobs for ever) stays until pushed out.
    return job.expires_at if job.expires_at > 0 else float("inf")


class FinishedJobs:
    """Final job records by id: at most `max_jobs` of them and `max_bytes` of their
    payloads, none past its expiry."""

    def __init__(
        self, max_jobs: int = MAX_JOBS, clock: Clock = SYSTEM, *, max_bytes: int = MAX_BYTES
    ) -> None:
        record_bytes = max(1, max_bytes // max_jobs)
        bound = record_bytes * max_jobs
        # Past this a record is not kept (and the cache could not hold it at all).
        self.largest_bytes = min(max_bytes // LARGEST_SHARE, bound - record_bytes)
        # Expiry is the record's own `expires_at`: epoch seconds, so the wall clock.
        self._jobs: TLRUCache[str, Job] = TLRUCache(
            maxsize=bound,
            ttu=_expires,
            timer=clock.wall,
            getsizeof=lambda job: record_bytes + job.payload_bytes,
        )

    def get(self, job_id: str) -> Job | None:
        found: Job | None = self._jobs.get(job_id)
        return found

    def remember(self, job: Job) -> None:
        """Keep `job` if it is final and not too large; a running one changes and is
        never kept."""
        if not job.status.final:
            return
        if job.payload_bytes > self.largest_bytes:
            self._jobs.pop(job.id, None)
            return
        self._jobs[job.id] = job

    @property
    def size_bytes(self) -> int:
        """What the records kept count against the bound: their payloads' bytes and
        a flat share each."""
        return int(self._jobs.currsize)

    def __len__(self) -> int:
        return len(self._jobs)


def outcome_recorded(
    job: Job, status: JobStatus, output: Any, tries: int, metrics: Metrics, quota: JobQuota | None
) -> None:
    """`job`'s outcome is in the store (at its `tries`-th write): counted and logged."""
    metrics.jobs.labels(str(status)).inc()
    if quota is not None and output is not None:
        quota.grow(job.id, json_size(output))
    outcome = str(status)
    if tries > 1:
        outcome += f" (recorded at try {tries}: the store had refused it)"
    _logged(job, outcome)


def outcome_discarded(job: Job) -> None:
    """`job`'s outcome was not recorded: the job is no longer this instance's."""
    _logged(job, "discarded (no longer owned)")


def _logged(job: Job, outcome: str) -> None:
    # Written after the answer that waits on it, with the access lines (logs.py).
    DEFERRED_LOGS.info(
        log, f"job {job.id} {outcome}", job_id=job.id, handler=job.handler, status=outcome
    )
