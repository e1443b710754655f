"""Stored-job quotas (`JobQuota`): how many jobs, and how many bytes of their inputs
and outputs, one key and the instance keep in the job store.

Every job is kept THAW_JOB_TTL_S after it is recorded, so a client storing
multi-MB inputs at a few jobs a second would grow the store until its disk
fills and readiness goes off for every tenant. A new job is refused past its
key's share (THAW_MAX_JOBS_PER_KEY jobs, THAW_MAX_JOB_BYTES_PER_KEY bytes) or
the instance's (THAW_MAX_JOBS, THAW_MAX_JOB_BYTES): 429 `quota-exceeded`, with
Retry-After until the oldest of the jobs counted against it expires. One
input larger than a whole share is 413 `payload-too-large`: no wait admits it.

What is counted: the jobs this instance recorded since it started, their
input and (once recorded) output bytes as JSON, each until its TTL ends. A
job without a key (auth off: loopback, Lambda) counts against the instance
only. Jobs recorded by other instances of a fleet, or before a restart, are
not counted here: each instance bounds what it writes.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

import orjson

from runtime.clock import SYSTEM, Clock
from runtime.errors import PayloadTooLarge, QuotaExceeded
from runtime.wire.outputs import JSON_OPTIONS


def json_bytes(value: object) -> bytes | None:
    """`value` as the store keeps it, JSON; None for what JSON cannot carry."""
    try:
        return orjson.dumps(value, option=JSON_OPTIONS)
    except TypeError:
        return None


def json_size(value: object) -> int:
    """Bytes of `value` as the store keeps it, JSON (0 for what JSON cannot carry:
    such an output is stored as its error)."""
    encoded = json_bytes(value)
    return 0 if encoded is None else len(encoded)


@dataclass
class _Counted:
    key_id: str | None
    size: int
    expires_at: float


@dataclass
class _Usage:
    jobs: int = 0
    size: int = 0


@dataclass(frozen=True)
class Limits:
    jobs_per_key: int
    bytes_per_key: int
    jobs: int
    bytes: int


class JobQuota:
    """The stored jobs counted against each key and the instance, until each expires."""

    def __init__(self, limits: Limits, *, ttl_s: float, clock: Clock = SYSTEM) -> None:
        self.limits = limits
        self.ttl_s = ttl_s
        self.clock = clock
        self.total = _Usage()
        self.by_key: dict[str | None, _Usage] = {}
        self._jobs: dict[str, _Counted] = {}
        # Oldest first: every job lives the same TTL, so they expire in this order.
        self._order: collections.deque[tuple[float, str]] = collections.deque()

    def admit(self, key_id: str | None, size: int) -> None:
        """Refuse a new job of `size` bytes that would pass a bound (raises)."""
        self._expire()
        limits = self.limits
        if key_id is not None:
            if size > limits.bytes_per_key:
                raise PayloadTooLarge(
                    f"a job input of {size} bytes exceeds THAW_MAX_JOB_BYTES_PER_KEY="
                    f"{limits.bytes_per_key}",
                    limit_bytes=limits.bytes_per_key,
                )
            mine = self.by_key.get(key_id, _Usage())
            if mine.jobs + 1 > limits.jobs_per_key:
                raise self._full(
                    key_id,
                    f"this key keeps {mine.jobs} jobs, THAW_MAX_JOBS_PER_KEY",
                    limits.jobs_per_key,
                )
            if mine.size + size > limits.bytes_per_key:
                raise self._full(
                    key_id,
                    f"this key's jobs hold {mine.size} bytes, {size} more would pass "
                    "THAW_MAX_JOB_BYTES_PER_KEY",
                    limits.bytes_per_key,
                )
        if size > limits.bytes:
            raise PayloadTooLarge(
                f"a job input of {size} bytes exceeds THAW_MAX_JOB_BYTES={limits.bytes}",
                limit_bytes=limits.bytes,
            )
        if self.total.jobs + 1 > limits.jobs:
            raise self._full(
                None, f"the instance keeps {self.total.jobs} jobs, THAW_MAX_JOBS", limits.jobs
            )
        if self.total.size + size > limits.bytes:
            raise self._full(
                None,
                f"the instance's jobs hold {self.total.size} bytes, {size} more would pass "
                "THAW_MAX_JOB_BYTES",
                limits.bytes,
            )

    def add(self, job_id: str, key_id: str | None, size: int) -> None:
        """Count job `job_id`, recorded now with an input of `size` bytes."""
        expires_at = self.clock.monotonic() + self.ttl_s
        self._jobs[job_id] = _Counted(key_id, 0, expires_at)
        self._order.append((expires_at, job_id))
        self.total.jobs += 1
        if key_id is not None:
            self.by_key.setdefault(key_id, _Usage()).jobs += 1
        self.grow(job_id, size)

    def grow(self, job_id: str, size: int) -> None:
        """Count `size` more bytes of job `job_id` (its output, once recorded)."""
        counted = self._jobs.get(job_id)
        if counted is None:
            return  # recorded before this instance started, or expired
        counted.size += size
        self.total.size += size
        if counted.key_id is not None:
            self.by_key[counted.key_id].size += size

    def _expire(self) -> None:
        now = self.clock.monotonic()
        order = self._order
        while order and order[0][0] <= now:
            _, job_id = order.popleft()
            counted = self._jobs.pop(job_id)
            self.total.jobs -= 1
            self.total.size -= counted.size
            if counted.key_id is not None:
                usage = self.by_key[counted.key_id]
                usage.jobs -= 1
                usage.size -= counted.size
                if usage.jobs == 0:
                    del self.by_key[counted.key_id]

    def _full(self, key_id: str | None, what: str, limit: int) -> QuotaExceeded:
        """The refusal, with Retry-After until the oldest job counted against it expires."""
        now = self.clock.monotonic()
        oldest = next(
            (at for at, job in self._order if key_id is None or self._jobs[job].key_id == key_id),
            now + self.ttl_s,
        )
        return QuotaExceeded(
            f"{what}={limit}; jobs are kept THAW_JOB_TTL_S={self.ttl_s:g} s",
            limit=limit,
            retry_after_s=max(1.0, math.ceil(oldest - now)),
        )
