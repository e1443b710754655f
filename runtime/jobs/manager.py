"""Jobs of this instance: create, follow with heartbeats, finish, poll, cancel, recover.

The work of a job is an asyncio task (started by the dispatcher). The manager
writes the job record, renews its lease while the work runs, and records the
outcome. Recovery is *lease based*: a job whose instance died stops being
heartbeated; the next instance that looks at it (a poll of `GET /jobs/{id}`,
or the maintenance sweep) claims it and runs its stored input again, up to
`THAW_JOB_MAX_ATTEMPTS`. The store's conditional writes make the claim
exclusive. On the dead instance's own node there is no need to wait for the
lease: an instance whose lock file in `<state_dir>/owners/` is unlocked is dead
(runtime/jobs/owners.py), and its running jobs are claimed at once.

Storage faults. A store that cannot serve raises `StorageUnavailable`; the
manager then holds the `job-store` health condition (readiness off, logged when
it starts and when it ends) until a write succeeds again, probing with a small
write meanwhile, so readiness comes back with no traffic. An outcome that cannot
be written is kept in memory and written again, with back-off, until the store
takes it, and the job's lease is renewed meanwhile; the sweep never claims a
job this instance still holds, even one whose lease lapsed while the store was
down, so a finished output is never lost nor computed twice. A job record that
vanished (a database deleted or replaced under the instance) is written again
by the instance that holds the job.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol, TypeVar

from runtime.clock import SYSTEM, Clock
from runtime.errors import (
    Conflict,
    Draining,
    HandlerError,
    StorageUnavailable,
    ThawError,
    UnknownJob,
)
from runtime.jobs.batch import CreateBatcher
from runtime.jobs.finished import FinishedJobs
from runtime.jobs.job import Job, JobStatus, new_job_id
from runtime.jobs.owners import OwnerLock
from runtime.jobs.store import JobStore
from runtime.telemetry.health import Health
from runtime.telemetry.logs import REQUEST_ID
from runtime.telemetry.metrics import Metrics
from runtime.wire.outputs import encode_output
from runtime.wire.render import job_error

log = logging.getLogger("thaw.jobs")
T = TypeVar("T")

# The health condition held while the job store cannot serve.
STORE_CONDITION = "job-store"
# Back-off between tries of an outcome write (and of the probe): short at first,
# as most outages are brief; capped so an outcome lands soon after space is freed.
RETRY_FIRST_S = 0.05
RETRY_MAX_S = 2.0
# How long a drain waits for outcomes the store does not take before giving up
# on them (the process is about to exit; their jobs run again elsewhere).
FINAL_WRITE_GRACE_S = 5.0


class JobRunner(Protocol):
    """Runs a stored job's input again on this instance: the dispatcher, which
    builds the manager with itself as the runner (runtime/dispatch/dispatcher.py)."""

    def run_job(self, job: Job) -> asyncio.Future[Any]:
        """Start the job's work; its future is the outcome."""
        ...

    def can_run(self, handler: str) -> bool:
        """Whether this instance has the handler: jobs of other functions sharing
        the store are left to their own instances."""
        ...


# What the job is doing right now: (phase, progress or None).
Probe = Callable[[], tuple[str, dict[str, Any] | None]]
# A job's final (status, output, error).
Outcome = tuple[JobStatus, Any, dict[str, Any] | None]


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
    # The outcome once the work ended: kept here until the store has it.
    outcome: Outcome | None = None
    # The id of the request that made the job (the job's own id for a recovered
    # one): the log context of every line about it (runtime.telemetry.logs.REQUEST_ID).
    request_id: str | None = None


def outcome_of(work: asyncio.Future[Any], handler: str) -> Outcome:
    try:
        output = work.result()
        # Checked before it is recorded: a store would write NaN as null, silently.
        encode_output(handler, output)
        return JobStatus.SUCCEEDED, output, None
    except asyncio.CancelledError:
        # Work is cancelled only by a drain (or by losing the job, whose outcome is discarded).
        drained = Draining("the instance drained before the job finished; submit it again")
        return JobStatus.FAILED, None, job_error(drained)
    except ThawError as exc:
        return JobStatus.FAILED, None, job_error(exc)
    except Exception as exc:
        # The dispatcher maps what user code raises; what is left came from the work all the same.
        return JobStatus.FAILED, None, job_error(HandlerError(f"{type(exc).__name__}: {exc}"))


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
    ) -> None:
        self.store = store
        # Leases and records are epoch seconds (`clock.wall()`, shared with other
        # instances); waits, back-offs and heartbeats run on `clock.monotonic()`.
        self.clock = clock
        self.owner = owner
        self.lease_s = lease_s
        self.max_attempts = max_attempts
        self.metrics = metrics
        self.health = health if health is not None else Health(clock)
        # This instance's lock file among its node's (None: no dead-owner recovery).
        self.owner_lock = OwnerLock(owners_dir, owner) if owners_dir is not None else None
        self.local: dict[str, LocalJob] = {}
        # Final records seen here: polls of a finished job are answered from
        # memory, the store down or not (runtime/jobs/finished.py).
        self.finished = FinishedJobs(clock=clock)
        # None (a manager on its own, in tests): jobs are claimed but not run again.
        self.runner = runner
        self.final_write_grace_s = FINAL_WRITE_GRACE_S
        self._idle = asyncio.Event()
        self._idle.set()
        self._creates = CreateBatcher(store.create_many)
        self._heartbeats: asyncio.Task[None] | None = None
        self._probe: asyncio.Task[None] | None = None
        # Set when a drain stops waiting for the store: pending outcomes are given up.
        self._give_up = asyncio.Event()
        self._abandoned = 0
        self._running = metrics.jobs.labels(str(JobStatus.RUNNING))

    # ---- store calls, and the health condition they drive ---------------------

    async def _read(self, fn: Callable[..., T], *args: Any) -> T:
        """A store call in a thread; a store that cannot serve turns readiness off."""
        try:
            return await asyncio.to_thread(fn, *args)
        except StorageUnavailable as exc:
            self._failing(exc)
            raise

    async def _write(self, fn: Callable[..., T], *args: Any) -> T:
        """A conditional store write; one that changed something (a truthy result)
        proves the store can write again. One that changed nothing proves nothing:
        SQLite writes no page for an UPDATE or DELETE that matches no row."""
        result = await self._read(fn, *args)
        if result:
            self.health.clear(STORE_CONDITION)
        return result

    def _failing(self, exc: StorageUnavailable) -> None:
        self.health.report(STORE_CONDITION, exc.message)
        if self._probe is None:
            # In a context of its own: it is no request's, though a request started it.
            self._probe = asyncio.get_running_loop().create_task(
                self._probe_until_writable(), context=contextvars.Context()
            )

    async def _probe_until_writable(self) -> None:
        """While the condition holds, try a small write now and then, so readiness
        comes back when the store does even if nothing else writes."""
        delay = RETRY_FIRST_S
        try:
            while STORE_CONDITION in self.health.conditions:
                await self.clock.sleep(delay)
                delay = min(2 * delay, RETRY_MAX_S)
                try:
                    await self._read(self.store.ping, self.owner)
                except StorageUnavailable:
                    continue
                except Exception:
                    log.debug("job store probe failed", exc_info=True)
                    continue
                self.health.clear(STORE_CONDITION)
        finally:
            self._probe = None

    async def _wait_set(self, event: asyncio.Event, timeout_s: float) -> bool:
        """Whether `event` is set within `timeout_s` (on the clock, not the loop's)."""
        if event.is_set():
            return True
        waiter = asyncio.ensure_future(event.wait())
        try:
            return await self.clock.wait_until(waiter, self.clock.monotonic() + timeout_s)
        finally:
            waiter.cancel()

    # ---- this instance's jobs ----------------------------------------------------

    async def record(self, handler: str, event: Any, *, phase: str, key_id: str | None) -> Job:
        """Write a new job, running and leased to this instance; returns once durable."""
        now = self.clock.wall()
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
        try:
            await self._creates.create(job)
        except StorageUnavailable as exc:
            self._failing(exc)
            raise
        self.health.clear(STORE_CONDITION)
        self._running.inc()
        return job

    def follow(self, job: Job, work: asyncio.Future[Any], probe: Probe) -> None:
        """Renew `job`'s lease while `work` runs, then record its outcome.

        One heartbeat loop serves every local job, and the outcome is written
        from `work`'s done callback: a 202 under a burst then costs a callback,
        not a task of its own that wakes up for each job.
        """
        local = LocalJob(job, work, probe, request_id=REQUEST_ID.get())
        self.local[job.id] = local
        self._idle.clear()
        # The done callback (and the task recording the outcome) run in the
        # context current here: the request's, so their lines carry its id.
        work.add_done_callback(partial(self._work_done, local))
        if self._heartbeats is None:
            # Every job's: in a context of its own, each beat setting its job's id.
            self._heartbeats = asyncio.get_running_loop().create_task(
                self._beat_while_running(), context=contextvars.Context()
            )

    def _work_done(self, local: LocalJob, work: asyncio.Future[Any]) -> None:
        local.outcome = outcome_of(work, local.job.handler)
        local.finisher = asyncio.get_running_loop().create_task(self._finish_local(local))

    async def _finish_local(self, local: LocalJob) -> None:
        try:
            await self._record_outcome(local)
        except Exception:
            log.exception("job %s: recording its outcome failed", local.job.id)
        finally:
            self.local.pop(local.job.id, None)
            local.done.set()
            if not self.local:
                self._idle.set()
                self._stop_heartbeats()

    async def _record_outcome(self, local: LocalJob) -> None:
        """Write the outcome, again and again while the store refuses it; the lease
        is renewed meanwhile (the job stays in `local`, which the sweep skips)."""
        assert local.outcome is not None
        job = local.job
        status, output, error = local.outcome
        recorded, tries, delay = False, 0, RETRY_FIRST_S
        while not local.released:
            tries += 1
            try:
                if await self._write(self.store.finish, job.id, self.owner, status, output, error):
                    recorded = True
                    break
                current = await self._read(self.store.get, job.id)
                if current is None:
                    if await self._restore(local, final=True):
                        recorded = True
                        break
                    # else restored meanwhile (running) by a heartbeat: finish that record
                elif current.owner == self.owner and current.status is status:
                    # Written by an earlier try whose answer was lost (the store
                    # refused to call it durable, a retried request found it done):
                    # only the owner can finish a job.
                    recorded = True
                    break
                elif current.owner != self.owner or current.status is not JobStatus.RUNNING:
                    break  # cancelled by a client, or claimed by another instance
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
            await self._wait_set(self._give_up, delay)
            delay = min(2 * delay, RETRY_MAX_S)
        if recorded:
            self.metrics.jobs.labels(str(status)).inc()
        outcome = str(status) if recorded else "discarded (no longer owned)"
        if recorded and tries > 1:
            outcome += f" (recorded at try {tries}: the store had refused it)"
        log.info(
            "job %s %s",
            job.id,
            outcome,
            extra={"job_id": job.id, "handler": job.handler, "status": outcome},
        )

    async def _restore(self, local: LocalJob, *, final: bool = False) -> bool:
        """Write a held job's record again if it vanished (its database was deleted
        or replaced): running and leased here, or with its outcome if `final`.
        True when written; False when a record exists (or appeared meanwhile)."""
        if await self._read(self.store.get, local.job.id) is not None:
            return False
        now = self.clock.wall()
        job = dataclasses.replace(
            local.job,
            status=JobStatus.RUNNING,
            owner=self.owner,
            lease_until=now + self.lease_s,
            progress=None,
        )
        if final and local.outcome is not None:
            status, output, error = local.outcome
            job = dataclasses.replace(
                job, status=status, phase=str(status), output=output, error=error, lease_until=None
            )
        try:
            await self._read(self.store.create, job)
        except Conflict:
            return False
        self.health.clear(STORE_CONDITION)
        log.warning(
            "job %s: its record had vanished from the job store (a deleted or replaced"
            " database); written again",
            job.id,
        )
        return True

    def _stop_heartbeats(self) -> None:
        if self._heartbeats is not None:
            self._heartbeats.cancel()
            self._heartbeats = None

    async def _beat_while_running(self) -> None:
        """Every third of a lease, renew the lease and the phase of each held job
        (including one whose outcome waits for the store)."""
        interval = max(0.05, self.lease_s / 3)
        try:
            while self.local:
                await self.clock.sleep(interval)
                held = [lj for lj in self.local.values() if not lj.released]
                if held:
                    await asyncio.gather(*map(self._beat, held))
        finally:
            if self._heartbeats is asyncio.current_task():
                self._heartbeats = None

    async def _beat(self, local: LocalJob) -> None:
        # Each beat is a task of its own (gather): the id is set for this job only.
        REQUEST_ID.set(local.request_id)
        job = local.job
        try:
            if await self._write(self.store.heartbeat, job.id, self.owner, self.lease_s):
                if not local.work.done():
                    phase, progress = local.probe()
                    await self._write(self.store.set_phase, job.id, self.owner, phase, progress)
                return
            current = await self._read(self.store.get, job.id)
            if current is None:
                await self._restore(local)
                return
            if current.owner == self.owner and current.status is JobStatus.RUNNING:
                return  # restored meanwhile by the finisher or a poll
        except StorageUnavailable:
            # The store cannot serve (the health condition says so, once): keep
            # running; the next beat tries again, and the sweep never takes a
            # job this instance holds.
            return
        except Exception:
            log.exception("job %s: heartbeat failed", job.id)
            return
        # Cancelled by a client (or claimed elsewhere): stop the work, discard its output.
        local.released = True
        local.work.cancel()

    # ---- client operations ----------------------------------------------------

    async def get(self, job_id: str, *, key_id: str | None, wait_s: float = 0.0) -> Job:
        """The job; long-polls up to `wait_s` for a final state; recovers lapsed jobs."""
        clock = self.clock
        deadline = clock.monotonic() + wait_s
        while True:
            job = await self._lookup(job_id)
            local = self.local.get(job_id)
            if job is None and local is not None and local.job.key_id == key_id:
                # Held here but gone from the store (a deleted database): write it again.
                await self._restore(local)
                job = await self._read(self.store.get, job_id)
            if job is None or job.key_id != key_id:
                raise UnknownJob(f"no job {job_id!r}")
            lapsed = job.lease_until is not None and job.lease_until < clock.wall()
            if job.status is JobStatus.RUNNING and local is None and lapsed:
                claimed = await self._claim_and_run(job)
                job = claimed or await self._read(self.store.get, job_id) or job
            self.finished.remember(job)
            remaining = deadline - clock.monotonic()
            if job.status.final or remaining <= 0:
                return job
            local = self.local.get(job_id)
            if local is not None:
                await self._wait_set(local.done, remaining)
            else:
                await clock.sleep(min(0.1, remaining))

    async def _lookup(self, job_id: str) -> Job | None:
        """The job as remembered if it is finished, else as the store has it."""
        finished = self.finished.get(job_id)
        if finished is not None:
            return finished
        return await self._read(self.store.get, job_id)

    async def cancel(self, job_id: str, *, key_id: str | None) -> Job:
        job = await self._lookup(job_id)
        if job is None or job.key_id != key_id:
            raise UnknownJob(f"no job {job_id!r}")
        if job.status.final:
            return job
        cancelled = await self._write(self.store.cancel, job_id)
        local = self.local.get(job_id)
        if local is not None:
            local.work.cancel()
        self.metrics.jobs.labels("cancelled").inc()
        if cancelled is not None:
            self.finished.remember(cancelled)
        return cancelled or job

    # ---- recovery -------------------------------------------------------------

    async def _claim_and_run(self, job: Job) -> Job | None:
        """Claim a job whose lease lapsed and run it here; None if not claimed.

        Never one this instance holds: its lease may have lapsed while the store
        was down, but its work is running here, or its outcome waits to be written.
        """
        if job.id in self.local or not self._can_run(job.handler):
            return None
        claimed: Job | None = await self._write(
            self.store.claim, job.id, self.owner, self.lease_s, self.max_attempts
        )
        if claimed is not None:
            self._run_recovered(claimed)
        return claimed

    def _can_run(self, handler: str) -> bool:
        return self.runner is None or self.runner.can_run(handler)

    def _run_recovered(self, claimed: Job) -> None:
        if self.runner is None:
            return
        # Its first request's id is not kept with the job: a recovered run is known by
        # the job's id (the request id its handler sees too), not by the poll or sweep
        # that claimed it.
        token = REQUEST_ID.set(claimed.id)
        try:
            log.info("recovering job %s (attempt %d)", claimed.id, claimed.attempts)
            work = self.runner.run_job(claimed)
            self.follow(claimed, work, lambda: ("running", None))
        finally:
            REQUEST_ID.reset(token)

    async def sweep(self) -> int:
        """Claim and run every lapsed job; returns how many."""
        ids: list[str] = await self._read(self.store.lapsed, 100)
        recovered = 0
        for job_id in ids:
            job = await self._read(self.store.get, job_id)
            if job is not None and await self._claim_and_run(job) is not None:
                recovered += 1
        if recovered:
            log.info("recovered %d lapsed job(s)", recovered)
        return recovered

    def hold_owner_lock(self) -> None:
        """Take this instance's lock file (blocking; idempotent): from now on, its
        death is visible to the next instance started on this node."""
        if self.owner_lock is not None:
            self.owner_lock.hold()

    async def reclaim_dead_owners(self) -> int:
        """Claim and run at once the running jobs of every dead owner of this node;
        returns how many. A dead owner's lock file is deleted once its jobs are taken
        care of, and kept for the next pass if the store failed."""
        if self.owner_lock is None or not self.owner_lock.held:
            return 0
        dead = await asyncio.to_thread(self.owner_lock.dead)
        reclaimed = 0
        for index, owner in enumerate(dead):
            try:
                reclaimed += await self._reclaim(owner.owner)
            except BaseException:
                for rest in dead[index:]:
                    rest.release(delete=False)
                raise
            owner.release(delete=True)
        return reclaimed

    async def _reclaim(self, dead_owner: str) -> int:
        reclaimed = 0
        seen: set[str] = set()
        while True:
            ids = await self._read(self.store.owned, dead_owner, 100)
            fresh = [job_id for job_id in ids if job_id not in seen]
            if not fresh:
                break
            for job_id in fresh:
                seen.add(job_id)
                job = await self._read(self.store.get, job_id)
                if job is None or not self._can_run(job.handler):
                    continue  # left to its lease, for an instance that has its handler
                claimed = await self._write(
                    self.store.claim_orphan,
                    job_id,
                    dead_owner,
                    self.owner,
                    self.lease_s,
                    self.max_attempts,
                )
                if claimed is not None:
                    self._run_recovered(claimed)
                    reclaimed += 1
        if seen:
            log.info(
                "owner %s died on this node: %d of its %d running job(s) taken at once",
                dead_owner,
                reclaimed,
                len(seen),
            )
        return reclaimed

    async def purge(self) -> int:
        """Delete expired jobs; returns how many."""
        return await self._write(self.store.purge_expired)

    async def maintain(self) -> None:
        """One maintenance pass: dead owners' jobs, then lapsed jobs, then expired ones.

        A store that cannot serve is already reported (once) by the health
        condition; each step is tried again at the next pass.
        """
        steps: tuple[tuple[str, Callable[[], Any]], ...] = (
            ("taking the jobs of dead owners", self.reclaim_dead_owners),
            ("the recovery sweep", self.sweep),
            ("purging expired jobs", self.purge),
        )
        for what, step in steps:
            try:
                await step()
            except StorageUnavailable:
                continue
            except Exception:
                log.exception("%s failed", what)

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
        if not await self._wait_set(self._idle, self.final_write_grace_s):
            self._give_up.set()
            await self._idle.wait()

    def close(self) -> None:
        """Stop probing and let go of the owner lock. Its file is deleted unless a job
        of this instance may still be running in the store (an outcome given up), so
        the next instance on this node takes that job at once."""
        if self._probe is not None:
            self._probe.cancel()
        if self.owner_lock is not None:
            self.owner_lock.release(delete=self._abandoned == 0 and not self.local)
