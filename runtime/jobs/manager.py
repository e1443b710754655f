"""Jobs of this instance: create, follow with heartbeats, finish, poll, cancel, recover.

The work of a job is an asyncio task (started by the dispatcher). The manager
writes the job record, renews its lease while the work runs, and records the
outcome. Recovery is *lease based*: a job whose instance died stops being
heartbeated; the next instance that looks at it (a poll of `GET /jobs/{id}`,
or the sweep at start-up) claims it and runs its stored input again, up to
`THAW_JOB_MAX_ATTEMPTS`. The store's conditional writes make the claim
exclusive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from runtime.errors import ThawError, UnknownJob
from runtime.jobs.batch import CreateBatcher
from runtime.jobs.job import Job, JobStatus, new_job_id
from runtime.jobs.store import JobStore
from runtime.metrics import Metrics

log = logging.getLogger("thaw.jobs")
T = TypeVar("T")

DRAINED_ERROR = {
    "type": "drained",
    "message": "the instance drained before the job finished; submit it again",
    "retryable": True,
}

# Re-runs a stored job's input on this instance (provided by the dispatcher).
Execute = Callable[[Job], "asyncio.Future[Any]"]
# What the job is doing right now: (phase, progress or None).
Probe = Callable[[], tuple[str, dict[str, Any] | None]]


@dataclass(slots=True)
class LocalJob:
    job: Job
    work: asyncio.Future[Any]
    probe: Probe
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # Set when the store says this instance no longer holds the job (a client
    # cancelled it, or another instance claimed it): its outcome is discarded.
    released: bool = False
    # The task recording the outcome: held here, as the loop keeps only weak references.
    finisher: asyncio.Task[None] | None = None


class JobManager:
    def __init__(
        self,
        store: JobStore,
        *,
        owner: str,
        lease_s: float,
        max_attempts: int,
        metrics: Metrics,
    ) -> None:
        self.store = store
        self.owner = owner
        self.lease_s = lease_s
        self.max_attempts = max_attempts
        self.metrics = metrics
        self.local: dict[str, LocalJob] = {}
        self.execute: Execute | None = None
        # Whether this instance has the job's handler; jobs of other functions
        # sharing the store are left to their own instances.
        self.can_run: Callable[[str], bool] = lambda handler: True
        self._idle = asyncio.Event()
        self._idle.set()
        self._creates = CreateBatcher(store.create_many)
        self._heartbeats: asyncio.Task[None] | None = None
        self._running = metrics.jobs.labels(str(JobStatus.RUNNING))

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.to_thread(fn, *args)

    async def record(self, handler: str, event: Any, *, phase: str, key_id: str | None) -> Job:
        """Write a new job, running and leased to this instance."""
        now = time.time()
        job = Job(
            id=new_job_id(),
            handler=handler,
            input=event,
            status=JobStatus.RUNNING,
            phase=phase,
            attempts=1,
            created_at=now,
            updated_at=now,
            owner=self.owner,
            lease_until=now + self.lease_s,
            key_id=key_id,
        )
        await self._creates.create(job)
        self._running.inc()
        return job

    def follow(self, job: Job, work: asyncio.Future[Any], probe: Probe) -> None:
        """Renew `job`'s lease while `work` runs, then record its outcome.

        One heartbeat loop serves every local job, and the outcome is written
        from `work`'s done callback: a 202 under a burst then costs a callback,
        not a task of its own that wakes up for each job.
        """
        local = LocalJob(job, work, probe)
        self.local[job.id] = local
        self._idle.clear()
        work.add_done_callback(partial(self._work_done, local))
        if self._heartbeats is None:
            self._heartbeats = asyncio.get_running_loop().create_task(self._beat_while_running())

    def _work_done(self, local: LocalJob, _work: asyncio.Future[Any]) -> None:
        local.finisher = asyncio.get_running_loop().create_task(self._finish_local(local))

    async def _finish_local(self, local: LocalJob) -> None:
        try:
            if not local.released:
                await self._finish(local.job, local.work)
        except Exception:
            # The store failed: the job stays running under a lease nobody
            # renews, so it lapses and is run again (see `_recover`).
            log.exception("job %s: recording its outcome failed", local.job.id)
        finally:
            self.local.pop(local.job.id, None)
            local.done.set()
            if not self.local:
                self._idle.set()
                self._stop_heartbeats()

    def _stop_heartbeats(self) -> None:
        if self._heartbeats is not None:
            self._heartbeats.cancel()
            self._heartbeats = None

    async def _beat_while_running(self) -> None:
        """Every third of a lease, renew the lease and the phase of each running job."""
        interval = max(0.05, self.lease_s / 3)
        try:
            while self.local:
                await asyncio.sleep(interval)
                running = [lj for lj in self.local.values() if not lj.work.done()]
                if running:
                    await asyncio.gather(*map(self._beat, running))
        finally:
            if self._heartbeats is asyncio.current_task():
                self._heartbeats = None

    async def _beat(self, local: LocalJob) -> None:
        job = local.job
        try:
            phase, progress = local.probe()
            held = await self._call(self.store.heartbeat, job.id, self.owner, self.lease_s)
            if held:
                await self._call(self.store.set_phase, job.id, self.owner, phase, progress)
                return
        except Exception:
            # The store is unreachable: keep running; the next beat tries again,
            # and the lease only lapses if it stays down for a whole lease.
            log.exception("job %s: heartbeat failed", job.id)
            return
        # Cancelled by a client (or claimed elsewhere): stop the work, discard its output.
        local.released = True
        local.work.cancel()

    async def _finish(self, job: Job, work: asyncio.Future[Any]) -> None:
        status, output = JobStatus.SUCCEEDED, None
        error: dict[str, Any] | None = None
        try:
            output = work.result()
        except asyncio.CancelledError:
            status, error = JobStatus.FAILED, dict(DRAINED_ERROR)
        except ThawError as exc:
            status, error = JobStatus.FAILED, exc.to_job_error()
        except Exception as exc:
            status = JobStatus.FAILED
            error = {"type": "handler-error", "message": f"{type(exc).__name__}: {exc}"}
        recorded = await self._call(self.store.finish, job.id, self.owner, status, output, error)
        if recorded:
            self.metrics.jobs.labels(str(status)).inc()
        outcome = str(status) if recorded else "discarded (no longer owned)"
        log.info(
            "job %s %s",
            job.id,
            outcome,
            extra={"job_id": job.id, "handler": job.handler, "status": outcome},
        )

    # ---- client operations ----------------------------------------------------

    async def get(self, job_id: str, *, key_id: str | None, wait_s: float = 0.0) -> Job:
        """The job; long-polls up to `wait_s` for a final state; recovers lapsed jobs."""
        deadline = time.monotonic() + wait_s
        while True:
            job = await self._call(self.store.get, job_id)
            if job is None or job.key_id != key_id:
                raise UnknownJob(f"no job {job_id!r}")
            lapsed = job.lease_until is not None and job.lease_until < time.time()
            if job.status is JobStatus.RUNNING and job.id not in self.local and lapsed:
                job = await self._recover(job) or job
            remaining = deadline - time.monotonic()
            if job.status.final or remaining <= 0:
                return job
            local = self.local.get(job_id)
            if local is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(local.done.wait(), timeout=remaining)
            else:
                await asyncio.sleep(min(0.1, remaining))

    async def cancel(self, job_id: str, *, key_id: str | None) -> Job:
        job = await self._call(self.store.get, job_id)
        if job is None or job.key_id != key_id:
            raise UnknownJob(f"no job {job_id!r}")
        if job.status.final:
            return job
        cancelled = await self._call(self.store.cancel, job_id)
        local = self.local.get(job_id)
        if local is not None:
            local.work.cancel()
        self.metrics.jobs.labels("cancelled").inc()
        return cancelled or job

    async def _recover(self, job: Job) -> Job | None:
        """Claim a job whose instance died and run it here."""
        if not self.can_run(job.handler):
            return None
        claimed: Job | None = await self._call(
            self.store.claim, job.id, self.owner, self.lease_s, self.max_attempts
        )
        if claimed is None:
            return await self._call(self.store.get, job.id)
        if self.execute is None:
            return claimed
        log.info("recovering job %s (attempt %d)", claimed.id, claimed.attempts)
        work = self.execute(claimed)
        self.follow(claimed, work, lambda: ("running", None))
        return claimed

    async def sweep(self) -> int:
        """Claim and run every lapsed job (at start-up); returns how many."""
        ids: list[str] = await self._call(self.store.lapsed, 100)
        recovered = 0
        for job_id in ids:
            job = await self._call(self.store.get, job_id)
            if job is not None and await self._recover(job) is not None:
                recovered += 1
        return recovered

    async def wait_idle(self) -> None:
        """Returns once no job of this instance is running."""
        await self._idle.wait()

    async def abort_all(self) -> None:
        """Cancel every local job's work; each is recorded as drained."""
        for local in list(self.local.values()):
            local.work.cancel()
        await self._idle.wait()
