"""The jobs this instance holds, and their leases: heartbeats and restored records.

A job held here (`LocalJob`) keeps its lease while its work runs and while its
outcome waits for the store. One heartbeat loop serves every held job: every
third of a lease it renews each lease and writes each job's phase, so a burst
of 202s costs one task, not one per job. A change of phase (queued -> loading
-> running) is written when it happens too (`phase_changed`): one write per
change, coalesced per job, so a poll never reads `queued` while tokens stream.
A heartbeat the store refuses means the job is no longer this instance's (a
client cancelled it, another instance claimed it): its work is stopped and its
output discarded. A held job whose record vanished (a database deleted or
replaced under the instance) is written again by `restore`.

Heartbeats and phases are fenced by the run: they carry the `attempts` the
claim returned, so a run whose lease lapsed and that was claimed again (by
another instance, or by this very owner) is refused, and stops. A job recorded
queued (its instance could not start it at once, runtime/dispatch/claims.py) is
held unclaimed, with no lease to renew, until `claim` takes it by id, or until
this instance's own fleet queue claims it (`take_back`: it looked while the
instance was idle, and its claim committed after the record), which hands its
claim to the held job: never a second run of it here, nor a second hold. `on_event`
stops at once the work of a held job cancelled on any instance, and after a gap
in the notifications reads the held jobs again. `outcome_of` is what a held
job's ended work is recorded as.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import orjson

from runtime.clock import Clock
from runtime.errors import Conflict, Draining, HandlerError, StorageUnavailable, ThawError
from runtime.jobs.job import Job, JobStatus
from runtime.jobs.store_access import RETRY_FIRST_S, RETRY_MAX_S, StoreAccess
from runtime.jobs.wakeups import Event
from runtime.telemetry.logs import REQUEST_ID
from runtime.wire.outputs import encode_output
from runtime.wire.render import job_error

log = logging.getLogger("thaw.jobs")

# What the job is doing right now: (phase, progress or None).
Probe = Callable[[], tuple[str, dict[str, Any] | None]]
# A job's final (status, output, error); a succeeded output as an orjson.Fragment of
# its JSON, encoded once (`outcome_of`).
Outcome = tuple[JobStatus, Any, dict[str, Any] | None]


def holds(job: Job, owner: str, attempt: int) -> bool:
    """Whether `job` (as read) is still run `attempt` of `owner`'s, running."""
    return job.owner == owner and job.attempts == attempt and job.status is JobStatus.RUNNING


def outcome_of(work: asyncio.Future[Any], handler: str) -> Outcome:
    try:
        output = work.result()
        if output is None:
            return JobStatus.SUCCEEDED, None, None
        # Checked before it is recorded (a store would write NaN as null, silently),
        # and encoded once: the store writes these bytes as they are, and the quota
        # counts them, with no serialization of their own (a few ms per MB each).
        return JobStatus.SUCCEEDED, orjson.Fragment(encode_output(handler, output)), None
    except asyncio.CancelledError:
        # Work is cancelled only by a drain (or by losing the job, whose outcome is discarded).
        drained = Draining("the instance drained before the job finished; submit it again")
        return JobStatus.FAILED, None, job_error(drained)
    except ThawError as exc:
        return JobStatus.FAILED, None, job_error(exc)
    except Exception as exc:
        # The dispatcher maps what user code raises; what is left came from the work all the same.
        return JobStatus.FAILED, None, job_error(HandlerError(f"{type(exc).__name__}: {exc}"))


async def wait_set(clock: Clock, event: asyncio.Event, timeout_s: float) -> bool:
    """Whether `event` is set within `timeout_s` (on the clock, not the loop's)."""
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        return await clock.wait_until(waiter, clock.monotonic() + timeout_s)
    finally:
        waiter.cancel()


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
    # False while the job is recorded queued (its instance could not start it at
    # once): not leased yet, so not heartbeated; `Leases.claim` takes it by id.
    claimed: bool = True
    # Writing its items to the store, for followers anywhere (runtime/jobs/items.py).
    writer: asyncio.Task[None] | None = None
    # Its run's items as they are made (a generator handler's), to write.
    source: Any = None


class Leases:
    """The held jobs by id (`local`), their heartbeat loop, and restoring their records."""

    def __init__(self, access: StoreAccess, *, owner: str, lease_s: float, clock: Clock) -> None:
        self.access = access
        self.store = access.store
        self.owner = owner
        self.lease_s = lease_s
        self.clock = clock
        self.local: dict[str, LocalJob] = {}
        # Jobs being recorded queued here (not held yet), by id: with the claim of this
        # instance's fleet queue that took one meanwhile, for `hold` (`take_back`).
        self.recording: dict[str, Job | None] = {}
        self._heartbeats: asyncio.Task[None] | None = None
        self._recheck: asyncio.Task[None] | None = None
        # Phase writes under way, by job id; the ids whose phase changed meanwhile.
        self._phase_writes: dict[str, asyncio.Task[None]] = {}
        self._phase_changed: set[str] = set()

    def hold(self, local: LocalJob) -> None:
        """Renew `local`'s lease from now on (until `drop`); a job recorded queued
        holds the claim taken back while its record was written, if one was."""
        self.local[local.job.id] = local
        taken = self.recording.pop(local.job.id, None)
        if taken is not None:
            local.job, local.claimed = taken, True
        if self._heartbeats is None:
            # Every job's: in a context of its own, each beat setting its job's id.
            self._heartbeats = asyncio.get_running_loop().create_task(
                self._beat_while_running(), context=contextvars.Context()
            )

    def drop(self, local: LocalJob) -> None:
        """`local` is no longer held here; the loop stops with the last one."""
        if self.local.get(local.job.id) is local:  # never another hold of its id
            del self.local[local.job.id]
        if not self.local:
            self.stop()

    def stop(self) -> None:
        if self._heartbeats is not None:
            self._heartbeats.cancel()
            self._heartbeats = None

    async def restore(self, local: LocalJob, *, final: bool = False) -> bool:
        """Write a held job's record again if it vanished (its database was deleted
        or replaced): running and leased here, or with its outcome if `final`.
        True when written; False when a record exists (or appeared meanwhile)."""
        access = self.access
        if await access.read(self.store.get, local.job.id) is not None:
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
            await access.read(self.store.create, job)
        except Conflict:
            return False
        access.serving()
        log.warning(
            "job %s: its record had vanished from the job store (a deleted or replaced"
            " database); written again",
            job.id,
        )
        return True

    async def claim(self, job_id: str, max_attempts: int, give_up: asyncio.Event) -> bool:
        """Claim a held job recorded queued, by id (one winner: `claim` locks the row);
        tried again while the store cannot serve, until `give_up`. False when another
        instance took it first or it was cancelled: it is released here."""
        local = self.local.get(job_id)
        if local is None or local.released:
            return False
        delay = RETRY_FIRST_S
        while not local.claimed:
            try:
                claimed = await self.access.write(
                    self.store.claim, job_id, self.owner, self.lease_s, max_attempts
                )
            except StorageUnavailable:
                if not await wait_set(self.clock, give_up, delay):
                    delay = min(2 * delay, RETRY_MAX_S)
                    continue
                claimed = None
            if local.claimed:
                break  # taken back meanwhile, by this instance's own fleet queue
            if claimed is None:
                log.info("job %s was taken by another instance (or cancelled) first", job_id)
                local.released = True
                return False
            local.job, local.claimed = claimed, True
        return True

    def take_back(self, claimed: Job) -> bool:
        """Whether `claimed`, just claimed by this instance's own fleet queue
        (runtime/jobs/fleet.py), is a job this instance recorded queued: its claim is
        then the held job's (or, its record still being written, `hold`'s), leased
        here from now on, and its waiting work's `claim` finds it won. False: a job
        of another instance's, to run here."""
        if claimed.id in self.recording:
            self.recording[claimed.id] = claimed
            return True
        local = self.local.get(claimed.id)
        if local is None:
            return False
        local.job, local.claimed = claimed, True
        return True

    def on_event(self, event: Event | None) -> None:
        """A job changed on some instance: one cancelled (on any instance, this one
        included) that runs here stops now, instead of at its next heartbeat."""
        if event is None:
            # Notifications may have been lost: read the held jobs again.
            if self.local and self._recheck is None:
                self._recheck = asyncio.get_running_loop().create_task(
                    self._recheck_held(), context=contextvars.Context()
                )
            return
        if event.status != JobStatus.CANCELLED:
            return
        local = self.local.get(event.job_id)
        if local is not None and not local.work.done():
            log.info("job %s was cancelled: stopping its work here", event.job_id)
            local.released = True
            local.work.cancel()

    async def _recheck_held(self) -> None:
        """After a gap in the notifications: stop the work of held jobs that were
        cancelled or taken over meanwhile (else their next heartbeat would)."""
        try:
            for local in list(self.local.values()):
                if local.work.done() or local.released or not local.claimed:
                    continue  # (a queued one's claim finds out)
                try:
                    current = await self.access.read(self.store.get, local.job.id)
                except StorageUnavailable:
                    return  # the heartbeats find out once the store serves
                if current is None:
                    continue  # vanished: the heartbeat restores it
                if not holds(current, self.owner, local.job.attempts):
                    log.info("job %s changed while notifications were lost: stopping", current.id)
                    local.released = True
                    local.work.cancel()
        finally:
            self._recheck = None

    def close(self) -> None:
        if self._recheck is not None:
            self._recheck.cancel()
        for task in list(self._phase_writes.values()):
            task.cancel()

    def phase_changed(self, job_id: str) -> None:
        """A held job's phase changed: write it now, not at the next heartbeat. One
        write at a time per job; a change while one is under way is written after it
        (the probe is read when the write runs, so a burst of changes is one or two)."""
        if job_id in self._phase_writes:
            self._phase_changed.add(job_id)
            return
        local = self.local.get(job_id)
        if local is None or not local.claimed or local.released:
            return  # a queued job's phase is written on its claim's first beat
        task = asyncio.get_running_loop().create_task(
            self._write_phase(local), context=contextvars.Context()
        )
        self._phase_writes[job_id] = task

    async def _write_phase(self, local: LocalJob) -> None:
        REQUEST_ID.set(local.request_id)
        job = local.job
        try:
            while not local.work.done() and not local.released:
                self._phase_changed.discard(job.id)
                phase, progress = local.probe()
                set_phase = partial(self.store.set_phase, attempt=job.attempts)
                await self.access.write(set_phase, job.id, self.owner, phase, progress, quick=True)
                if job.id not in self._phase_changed:
                    break
        except StorageUnavailable:
            pass  # the next heartbeat writes it, once the store serves
        except Exception:
            log.exception("job %s: writing its phase failed", job.id)
        finally:
            self._phase_changed.discard(job.id)
            self._phase_writes.pop(job.id, None)

    async def _beat_while_running(self) -> None:
        """Every third of a lease, renew the lease and the phase of each held job
        (including one whose outcome waits for the store)."""
        interval = max(0.05, self.lease_s / 3)
        try:
            while self.local:
                await self.clock.sleep(interval)
                held = [lj for lj in self.local.values() if lj.claimed and not lj.released]
                if held:
                    await asyncio.gather(*map(self._beat, held))
        finally:
            if self._heartbeats is asyncio.current_task():
                self._heartbeats = None

    async def _beat(self, local: LocalJob) -> None:
        # Each beat is a task of its own (gather): the id is set for this job only.
        REQUEST_ID.set(local.request_id)
        job, access, store = local.job, self.access, self.store
        # Fenced by the run (the claim's `attempts`), not only by owner: a later run
        # of this very job, by this owner too, refuses this one's writes.
        attempt = job.attempts
        try:
            heartbeat = partial(store.heartbeat, attempt=attempt)
            if await access.write(heartbeat, job.id, self.owner, self.lease_s):
                if not local.work.done():
                    phase, progress = local.probe()
                    set_phase = partial(store.set_phase, attempt=attempt)
                    await access.write(set_phase, job.id, self.owner, phase, progress)
                return
            current = await access.read(store.get, job.id)
            if current is None:
                await self.restore(local)
                return
            if holds(current, self.owner, job.attempts):
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
