"""Jobs of this instance: create, follow, finish, poll, cancel; recovery and leases delegated.

The work of a job is an asyncio task (started by the dispatcher). The manager
writes the job record, has its lease renewed while the work runs
(runtime/jobs/leases.py: one heartbeat loop for every held job), and records
the outcome. Jobs whose instance died are claimed and run again by recovery
(runtime/jobs/recovery.py: lapsed leases, and dead owners of this node at once).

Storage faults. A store that cannot serve raises `StorageUnavailable`; the
`job-store` health condition then holds (readiness off) until a write succeeds
again (runtime/jobs/store_access.py, which probes meanwhile). An outcome that cannot
be written is kept in memory and written again, with back-off, until the store
takes it, and the job's lease is renewed meanwhile; recovery never claims a job
this instance still holds, even one whose lease lapsed while the store was
down, so a finished output is never lost nor computed twice. A job record that
vanished (a database deleted or replaced under the instance) is written again
by the instance that holds the job.

Time: records and leases are epoch seconds on `clock.wall()` (other instances
compare them); waits, back-offs and heartbeats run on `clock.monotonic()` and
its timers, so a test moves them all with a `ManualClock`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from functools import partial
from pathlib import Path
from typing import Any

from runtime.clock import SYSTEM, Clock
from runtime.errors import StorageUnavailable, UnknownJob
from runtime.jobs.finished import FinishedJobs, outcome_discarded, outcome_recorded
from runtime.jobs.group_commit import GroupCommit
from runtime.jobs.items import ItemSource, JobItems
from runtime.jobs.job import Job, JobStatus, new_job_id
from runtime.jobs.leases import Leases, LocalJob, Probe, outcome_of, wait_set
from runtime.jobs.quota import JobQuota, json_bytes
from runtime.jobs.recovery import JobRunner, Recovery
from runtime.jobs.store import JobStore
from runtime.jobs.store_access import RETRY_FIRST_S, RETRY_MAX_S, STORE_CONDITION, StoreAccess
from runtime.jobs.wakeups import Wakeups
from runtime.telemetry.health import Health
from runtime.telemetry.logs import REQUEST_ID
from runtime.telemetry.metrics import Metrics

__all__ = ["STORE_CONDITION", "JobManager", "JobRunner", "LocalJob", "Probe", "outcome_of"]

log = logging.getLogger("thaw.jobs")

# How long a drain waits for outcomes the store does not take before giving up
# on them (the process is about to exit; their jobs run again elsewhere).
FINAL_WRITE_GRACE_S = 5.0
# A long poll woken by notifications still reads the job this often: its owner may
# have died without a word, and the poll is what recovers a lapsed lease.
RECHECK_S = 5.0


class JobManager:
    def __init__(
        self,
        store: JobStore,
        *,
        owner: str,
        lease_s: float,
        max_attempts: int,
        metrics: Metrics,
        health: Health | None = None,
        owners_dir: Path | None = None,
        runner: JobRunner | None = None,
        clock: Clock = SYSTEM,
        quota: JobQuota | None = None,
    ) -> None:
        self.store = store
        self.owner = owner
        self.lease_s = lease_s
        self.max_attempts = max_attempts
        self.metrics = metrics
        self.clock = clock
        # What each key (and the instance) may keep stored; None: unbounded.
        self.quota = quota
        self.health = health if health is not None else Health(clock)
        self.access = StoreAccess(store, owner=owner, health=self.health, clock=clock)
        self.leases = Leases(self.access, owner=owner, lease_s=lease_s, clock=clock)
        # The jobs held here, by id (the leases' own dict).
        self.local: dict[str, LocalJob] = self.leases.local
        self.recovery = Recovery(
            self.access,
            owner=owner,
            lease_s=lease_s,
            max_attempts=max_attempts,
            held=self.local.__contains__,
            follow=self.follow,
            runner=runner,
            owners_dir=owners_dir,
        )
        # Final records seen here: polls of a finished job are answered from
        # memory, the store down or not (runtime/jobs/finished.py).
        self.finished = FinishedJobs(clock=clock)
        self.final_write_grace_s = FINAL_WRITE_GRACE_S
        self._idle = asyncio.Event()
        self._idle.set()
        self._creates = GroupCommit(store.create_many, store.now)
        # Set when a drain stops waiting for the store: pending outcomes are given up.
        self._give_up = asyncio.Event()
        # Streaming jobs' items in the store, when it keeps them (runtime/jobs/items.py).
        self.items = JobItems(self.access, owner=owner, clock=clock, give_up=self._give_up)
        self._abandoned = 0
        self._running = metrics.jobs.labels(str(JobStatus.RUNNING))
        self._queued = metrics.jobs.labels(str(JobStatus.QUEUED))
        # Changes of jobs made by other instances of a fleet, when the store tells
        # them (runtime/jobs/wakeups.py; started by runtime/jobs/fleet.py).
        self.wakeups = Wakeups(clock)
        self.wakeups.subscribe(self.leases.on_event)
        # Whether jobs recorded queued are taken by the fleet's idle instances (set
        # by runtime/jobs/fleet.py): only then does the dispatcher record any.
        self.shared_queue = False

    # ---- this instance's jobs ----------------------------------------------------

    async def record(
        self, handler: str, event: Any, *, phase: str, key_id: str | None, queued: bool = False
    ) -> Job:
        """Write a new job, running and leased to this instance (or `queued`: for any
        instance to claim, this one by `claim_queued` when it gets to it); returns once
        durable. Refused past the key's or the instance's stored-job quota (quota.py)."""
        quota, encoded = self.quota, json_bytes(event)  # None: the store's write says why
        size = 0 if encoded is None else len(encoded)
        if quota is not None:
            quota.admit(key_id, size)
        now = self.clock.wall()
        job = Job(
            id=new_job_id(),
            handler=handler,
            input=event,
            status=JobStatus.QUEUED if queued else JobStatus.RUNNING,
            phase=phase,
            attempts=0 if queued else 1,
            created_at=now,
            updated_at=now,
            owner=None if queued else self.owner,
            lease_until=None if queued else now + self.lease_s,
            key_id=key_id,
            payload_bytes=size,
        )
        if queued:  # the fleet's once committed, this instance's fleet queue included
            self.leases.recording[job.id] = None
        try:
            await self._creates.create(job, encoded)  # the bytes counted are those written
        except BaseException as exc:
            self.leases.recording.pop(job.id, None)
            if isinstance(exc, StorageUnavailable):
                self.access.failing(exc)
            raise
        self.access.serving()
        (self._queued if queued else self._running).inc()
        if quota is not None:
            quota.add(job.id, key_id, size)
        return job

    async def finish_ended(self, job: Job, work: asyncio.Future[Any]) -> Job | None:
        """The final record of `job`, just created, whose `work` ended before its answer
        was sent: written at once (one try), so the answer is final too and nothing
        follows it. None when that try did not record it: `follow` it then (retries)."""
        if job.id in self.leases.recording:
            return None  # recorded queued (unclaimed, or taken back): `follow` it
        status, output, error = outcome_of(work, job.handler)
        finish = partial(self.store.finish, attempt=job.attempts)  # fenced
        try:
            final = await self.access.write(
                finish, job.id, self.owner, status, output, error, quick=True
            )
        except StorageUnavailable:
            return None
        if final is None:
            return None
        self.finished.remember(final)
        outcome_recorded(final, status, output, 1, self.metrics, self.quota)
        return final

    def follow(
        self,
        job: Job,
        work: asyncio.Future[Any],
        probe: Probe,
        items: ItemSource | None = None,
    ) -> None:
        """Renew `job`'s lease while `work` runs (writing its `items` where the store
        keeps them), then record its outcome.

        One heartbeat loop serves every local job, and the outcome is written
        from `work`'s done callback: a 202 under a burst then costs a callback,
        not a task of its own that wakes up for each job.
        """
        local = LocalJob(job, work, probe, request_id=REQUEST_ID.get())
        local.claimed = job.status is JobStatus.RUNNING
        local.source = items
        self.leases.hold(local)
        if local.claimed:
            self.items.start(local, items)
            if probe()[0] != job.phase:  # it changed while its record was created
                self.leases.phase_changed(job.id)
        self._idle.clear()
        # The done callback (and the task recording the outcome) run in the
        # context current here: the request's, so their lines carry its id.
        work.add_done_callback(partial(self._work_done, local))

    def phase_changed(self, job_id: str) -> None:
        """The phase of a job held here changed: written now (runtime/jobs/leases.py)."""
        self.leases.phase_changed(job_id)

    def _work_done(self, local: LocalJob, work: asyncio.Future[Any]) -> None:
        local.outcome = outcome_of(work, local.job.handler)
        local.finisher = asyncio.get_running_loop().create_task(self._finish_local(local))

    async def claim_queued(self, job_id: str) -> bool:
        """Claim by id a job held here but recorded queued, as its work is about to run
        here; False when another instance took it first (or it was cancelled): its
        work must not run here, and its outcome is discarded."""
        if not await self.leases.claim(job_id, self.max_attempts, self._give_up):
            return False
        local = self.local[job_id]
        self._running.inc()
        self.items.start(local, local.source)
        self.leases.phase_changed(job_id)  # the claim wrote `claimed`; the work is further
        return True

    async def _finish_local(self, local: LocalJob) -> None:
        try:
            if not local.claimed and not local.work.cancelled():
                # Ended before it ran (a load failed): recorded if this one wins the claim.
                await self.claim_queued(local.job.id)
            await self.items.flushed(local)
            await self._record_outcome(local)
        except Exception:
            log.exception("job %s: recording its outcome failed", local.job.id)
        finally:
            self.leases.drop(local)
            local.done.set()
            if not self.local:
                self._idle.set()

    async def _record_outcome(self, local: LocalJob) -> None:
        """Write the outcome, again and again while the store refuses it; the lease
        is renewed meanwhile (the job stays in `local`, which the sweep skips)."""
        assert local.outcome is not None
        job, access, store = local.job, self.access, self.store
        status, output, error = local.outcome
        recorded, tries, delay = False, 0, RETRY_FIRST_S
        while not local.released:
            job = local.job  # each try: a queued job may be taken back meanwhile
            run = (self.owner, job.attempts)
            tries += 1
            try:
                finish = partial(store.finish, attempt=job.attempts)  # fenced
                final = await access.write(
                    finish, job.id, self.owner, status, output, error, quick=True
                )
                if final is not None:
                    # Its polls (the caller's long-poll waits on `done`) are answered
                    # from memory, with no store read of their own.
                    self.finished.remember(final)
                    recorded = True
                    break
                current = await access.read(store.get, job.id, quick=True)
                mine = current is not None and (current.owner, current.attempts) == run
                if current is None:
                    if await self.leases.restore(local, final=True):
                        recorded = True
                        break
                    # else restored meanwhile (running) by a heartbeat: finish that record
                elif mine and current.status is status:
                    # Written by an earlier try whose answer was lost (the store
                    # refused to call it durable, a retried request found it done):
                    # only the owner can finish a job.
                    recorded = True
                    break
                elif not mine or current.status is not JobStatus.RUNNING:
                    break  # cancelled by a client, or claimed again (elsewhere or here)
                failure: Exception | None = None
            except Exception as exc:
                failure = exc
                if not isinstance(exc, StorageUnavailable):
                    log.warning("job %s: recording its outcome failed: %r", job.id, exc)
            if self._give_up.is_set():
                self._abandoned += 1
                log.error(
                    "job %s: its %s outcome was never recorded (%s); it runs again"
                    " once its lease lapses",
                    job.id,
                    status,
                    failure or "the record kept changing",
                )
                return
            await wait_set(self.clock, self._give_up, delay)
            delay = min(2 * delay, RETRY_MAX_S)
        if recorded:
            outcome_recorded(job, status, output, tries, self.metrics, self.quota)
        else:
            outcome_discarded(job)

    # ---- client operations ----------------------------------------------------

    async def get(self, job_id: str, *, key_id: str | None, wait_s: float = 0.0) -> Job:
        """The job; long-polls up to `wait_s` for a final state; recovers lapsed jobs."""
        if wait_s <= 0 or not self.wakeups.supported:
            return await self._get(job_id, key_id, wait_s, None)
        # Watched before the first read: a change committed between a read and the
        # wait that follows it still wakes the wait.
        changed = self.wakeups.watch(job_id)
        try:
            return await self._get(job_id, key_id, wait_s, changed)
        finally:
            self.wakeups.unwatch(job_id, changed)

    async def _get(
        self, job_id: str, key_id: str | None, wait_s: float, changed: asyncio.Event | None
    ) -> Job:
        clock = self.clock
        deadline = clock.monotonic() + wait_s
        local = self.local.get(job_id)
        if wait_s > 0 and local is not None and local.job.key_id == key_id:
            # Held here, for this key: its end is heard here, so wait for it before
            # any read (then answered from `finished`, which its outcome filled).
            await wait_set(clock, local.done, wait_s)
        while True:
            if changed is not None:
                changed.clear()
            held_before = job_id in self.local
            remembered = self.finished.get(job_id)
            if remembered is not None and remembered.key_id == key_id:
                return remembered  # final: nothing to wait for, nor to remember again
            # Not remembered for this key: read as `_lookup` would, without asking again.
            job = await self.access.read(self.store.get, job_id, quick=True)
            local = self.local.get(job_id)
            if job is None and local is not None and local.job.key_id == key_id:
                # Held here but gone from the store (a deleted database): write it again.
                await self.leases.restore(local)
                job = await self.access.read(self.store.get, job_id)
            if job is None or job.key_id != key_id:
                raise UnknownJob(f"no job {job_id!r}")
            lapsed = job.lease_until is not None and job.lease_until < clock.wall()
            if job.status is JobStatus.RUNNING and local is None and lapsed:
                claimed = await self.recovery.claim_and_run(job)
                job = claimed or await self.access.read(self.store.get, job_id) or job
            self.finished.remember(job)
            remaining = deadline - clock.monotonic()
            if job.status.final or remaining <= 0:
                return job
            local = self.local.get(job_id)
            if local is not None:
                await wait_set(clock, local.done, remaining)
            elif changed is not None:
                # Woken by the job's next change on any instance; read again now and
                # then all the same, for a lease that lapses (its owner says nothing).
                await wait_set(clock, changed, min(remaining, RECHECK_S))
            elif not held_before:
                await clock.sleep(min(0.1, remaining))
            # else it finished here while the store was read: read its outcome at once

    def stored_items(
        self, job_id: str, *, key_id: str | None, start: int, idle_s: float
    ) -> AsyncGenerator[list[Any] | Job, None] | None:
        """A follower's items of the job from index `start`, then the final job, read
        from the store wherever the job runs (runtime/jobs/items.py); None when the
        store keeps no items (SQLite, DynamoDB)."""
        if self.items.store is None:
            return None
        get = partial(self.get, job_id, key_id=key_id)
        return self.items.follow(job_id, start, idle_s, get, self.wakeups)

    async def _lookup(self, job_id: str, key_id: str | None) -> Job | None:
        """The job as remembered if it is finished and `key_id`'s, else as the store has it.

        Another key's finished job is read from the store like an unknown id, so
        that both answers take the same work (no timing oracle: docs/security.md).
        """
        finished = self.finished.get(job_id)
        if finished is not None and finished.key_id == key_id:
            return finished
        return await self.access.read(self.store.get, job_id, quick=True)

    async def cancel(self, job_id: str, *, key_id: str | None) -> Job:
        job = await self._lookup(job_id, key_id)
        if job is None or job.key_id != key_id:
            raise UnknownJob(f"no job {job_id!r}")
        if job.status.final:
            return job
        cancelled = await self.access.write(self.store.cancel, job_id)
        local = self.local.get(job_id)
        if local is not None:
            local.work.cancel()
        self.metrics.jobs.labels("cancelled").inc()
        if cancelled is not None:
            self.finished.remember(cancelled)
        return cancelled or job

    # ---- recovery (runtime/jobs/recovery.py) ----------------------------------

    async def sweep(self) -> int:
        """Claim and run every lapsed job; returns how many."""
        return await self.recovery.sweep()

    def hold_owner_lock(self) -> None:
        """Take this instance's lock file (blocking; idempotent)."""
        self.recovery.hold_owner_lock()

    async def reclaim_dead_owners(self) -> int:
        """Claim and run at once the running jobs of every dead owner of this node."""
        return await self.recovery.reclaim_dead_owners()

    async def maintain(self) -> None:
        """One maintenance pass: dead owners' jobs, then lapsed jobs, then expired ones."""
        await self.recovery.maintain()

    # ---- drain ---------------------------------------------------------------

    async def wait_idle(self) -> None:
        """Returns once no job of this instance is running or waiting to be recorded."""
        await self._idle.wait()

    async def abort_all(self) -> None:
        """Cancel every local job's work; each is recorded as drained.

        Outcomes the store keeps refusing are given up after
        `final_write_grace_s`: the process is about to exit, and their jobs
        run again elsewhere once their leases lapse.
        """
        for local in list(self.local.values()):
            local.work.cancel()
        if not await wait_set(self.clock, self._idle, self.final_write_grace_s):
            self._give_up.set()
            await self._idle.wait()

    def close(self) -> None:
        """Stop probing and let go of the owner lock. Its file is deleted unless a job
        of this instance may still be running in the store (an outcome given up), so
        the next instance on this node takes that job at once."""
        self.access.close()
        self.leases.close()
        if self.recovery.owner_lock is not None:
            self.recovery.owner_lock.release(delete=self._abandoned == 0 and not self.local)
