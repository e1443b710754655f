"""The job store contract, and the store named by `THAW_JOB_STORE`.

Stores are synchronous (SQLite and boto3 are); async callers run them in a
thread. `open_store` picks one from the URL; `DeferredStore` opens it on
first use, so /healthz never waits for it.

A store may also run a call at once on the caller's thread, the event loop's,
when nothing can make it wait (`now`; runtime/jobs/store_access.py): a local SQLite
file whose write lock is free. A thread hop costs more than such a call (two
wake-ups: 130 us on the 2-core VM that measures issue 29's job cycle), and the
202 path and a job's end each make one. Any other answer is NOT_NOW, and the
caller runs the call in a thread as before.

A store translates its backend's failures (sqlite3, OSError, botocore) once,
at its boundary, into `StorageUnavailable` (503 storage-unavailable, with
Retry-After): callers never see a foreign exception, and nothing that needs a
durable record is acknowledged while the store cannot write.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from runtime.clock import SYSTEM, Clock
from runtime.errors import ConfigError, Conflict
from runtime.jobs.job import Job, JobStatus
from runtime.jobs.stores.not_now import NOT_NOW, NotNow, T


class JobStore(Protocol):
    """The contract every job store meets (one test suite runs against all)."""

    def now(self, call: Callable[[], T], *, writes: bool) -> T | NotNow:
        """`call` (this store's own methods, bound: one small call) run on this thread
        at once, if nothing can make it wait (a lock held elsewhere, I/O that may
        stall: a network store never runs now); else NOT_NOW, having done nothing.
        `writes`: whether the call writes (a read-only call that writes is NOT_NOW)."""
        ...

    def create(self, job: Job) -> None:
        """Insert a new job; its id must be unused."""
        ...

    def create_many(self, jobs: Sequence[Job]) -> list[Conflict | None]:
        """Insert new jobs in one write where the store can; per job, None or its Conflict."""
        ...

    def get(self, job_id: str) -> Job | None:
        """The job, or None if unknown or expired."""
        ...

    def claim(self, job_id: str, owner: str, lease_s: float, max_attempts: int) -> Job | None:
        """Take the job to run it.

        Succeeds (returns the job, now `running`, attempts + 1, leased to
        `owner`) when it is queued, or running with a lapsed lease and fewer
        than `max_attempts` attempts. A lapsed job out of attempts is failed
        with error type `worker-lost`. Otherwise returns None.
        """
        ...

    def claim_orphan(
        self, job_id: str, dead_owner: str, owner: str, lease_s: float, max_attempts: int
    ) -> Job | None:
        """Take a running job of `dead_owner`, whatever its lease, to run it again.

        For an owner known to be dead (runtime/jobs/owners.py), so its jobs need
        not wait for their leases to lapse. Succeeds as `claim` does (running,
        attempts + 1, leased to `owner`) when the job is still running under
        `dead_owner` with fewer than `max_attempts` attempts; such a job out of
        attempts is failed with `worker-lost`. Otherwise (finished, cancelled,
        claimed by someone else) returns None.
        """
        ...

    def owned(self, owner: str, limit: int = 100) -> list[str]:
        """Ids of the running jobs leased to `owner` (whatever their lease), oldest first."""
        ...

    def ping(self, owner: str) -> None:
        """A small real write that leaves no job changed; raises `StorageUnavailable`
        while the store cannot write (how an instance learns it can again)."""
        ...

    def heartbeat(
        self, job_id: str, owner: str, lease_s: float, *, attempt: int | None = None
    ) -> bool:
        """Renew the lease; False when `owner` no longer holds a running job.

        `attempt` (here and below): the `attempts` of the Job the claim returned,
        the run's fencing token; given, the write succeeds only for that very run,
        so a late write of an earlier run (the same owner's too) changes nothing."""
        ...

    def set_phase(
        self,
        job_id: str,
        owner: str,
        phase: str,
        progress: dict[str, Any] | None = None,
        *,
        attempt: int | None = None,
    ) -> bool: ...

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
        job: the record as written (read by the write itself where the store can), or
        None when it was not."""
        ...

    def cancel(self, job_id: str) -> Job | None:
        """Queued or running -> cancelled; returns the job as it now is."""
        ...

    def lapsed(self, limit: int = 100) -> list[str]:
        """Ids of running jobs whose lease has lapsed, and of queued jobs, oldest first."""
        ...

    def purge_expired(self) -> int: ...

    def close(self) -> None: ...


_POSTGRES = ("postgresql://", "postgres://")


def _check_scheme(url: str) -> None:
    if not url.startswith(("sqlite://", "dynamodb://", *_POSTGRES)):
        raise ConfigError(
            f"THAW_JOB_STORE={url!r}: expected sqlite:///path, dynamodb://table"
            " or postgresql://user@host:port/db"
        )


def open_store(url: str, *, ttl_s: float, clock: Clock = SYSTEM) -> JobStore:
    """The store `url` names; its records' times (created_at, leases, expiry) are `clock.wall()`."""
    _check_scheme(url)
    if url.startswith("sqlite://"):
        from runtime.jobs.stores.sqlite import SQLiteJobStore

        return SQLiteJobStore.from_url(url, ttl_s=ttl_s, clock=clock)
    if url.startswith(_POSTGRES):
        from runtime.jobs.stores.postgres import PostgresJobStore

        return PostgresJobStore.from_url(url, ttl_s=ttl_s, clock=clock)
    from runtime.jobs.stores.dynamodb import DynamoDBJobStore

    return DynamoDBJobStore.from_url(url, ttl_s=ttl_s, clock=clock)


class DeferredStore:
    """The store of `url`, opened by `open()` or by the first call that needs it.

    Opening is I/O (SQLite's schema, boto3's import and client) that /healthz
    does not need, so a server opens it in a worker thread once it listens.
    A call arriving before that finished waits for it (in its own worker
    thread: every store call runs in one). The URL's scheme is checked at once.
    """

    def __init__(self, url: str, *, ttl_s: float, clock: Clock = SYSTEM) -> None:
        _check_scheme(url)
        self.url = url
        self.ttl_s = ttl_s
        self.clock = clock
        self._store: JobStore | None = None
        self._lock = threading.Lock()

    @property
    def opened(self) -> bool:
        return self._store is not None

    def now(self, call: Callable[[], T], *, writes: bool) -> T | NotNow:
        # Never opens the store: opening is I/O, for a thread.
        store = self._store
        return NOT_NOW if store is None else store.now(call, writes=writes)

    def open(self) -> JobStore:
        """The store, opened on the first call (once, however many threads ask)."""
        store = self._store
        if store is None:
            with self._lock:
                if self._store is None:
                    self._store = open_store(self.url, ttl_s=self.ttl_s, clock=self.clock)
                store = self._store
        return store

    def create(self, job: Job) -> None:
        self.open().create(job)

    def create_many(self, jobs: Sequence[Job]) -> list[Conflict | None]:
        return self.open().create_many(jobs)

    def get(self, job_id: str) -> Job | None:
        return self.open().get(job_id)

    def claim(self, job_id: str, owner: str, lease_s: float, max_attempts: int) -> Job | None:
        return self.open().claim(job_id, owner, lease_s, max_attempts)

    def claim_orphan(
        self, job_id: str, dead_owner: str, owner: str, lease_s: float, max_attempts: int
    ) -> Job | None:
        return self.open().claim_orphan(job_id, dead_owner, owner, lease_s, max_attempts)

    def owned(self, owner: str, limit: int = 100) -> list[str]:
        return self.open().owned(owner, limit)

    def ping(self, owner: str) -> None:
        self.open().ping(owner)

    def heartbeat(
        self, job_id: str, owner: str, lease_s: float, *, attempt: int | None = None
    ) -> bool:
        return self.open().heartbeat(job_id, owner, lease_s, attempt=attempt)

    def set_phase(
        self,
        job_id: str,
        owner: str,
        phase: str,
        progress: dict[str, Any] | None = None,
        *,
        attempt: int | None = None,
    ) -> bool:
        return self.open().set_phase(job_id, owner, phase, progress, attempt=attempt)

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
        return self.open().finish(job_id, owner, status, output, error, attempt=attempt)

    def cancel(self, job_id: str) -> Job | None:
        return self.open().cancel(job_id)

    def lapsed(self, limit: int = 100) -> list[str]:
        return self.open().lapsed(limit)

    def purge_expired(self) -> int:
        return self.open().purge_expired()

    def close(self) -> None:
        """Close the store if it was opened (never opens one just to close it)."""
        with self._lock:
            store = self._store
        if store is not None:
            store.close()
