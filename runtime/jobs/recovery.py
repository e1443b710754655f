"""Recovery: jobs whose instance died are claimed and run again here.

Lease based: a job whose instance died stops being heartbeated; the next
instance that looks at it (a poll of `GET /jobs/{id}`, or the maintenance
sweep) claims it and runs its stored input again, up to
`THAW_JOB_MAX_ATTEMPTS`. The store's conditional writes make the claim
exclusive. On the dead instance's own node there is no need to wait for the
lease: an instance whose lock file in `<state_dir>/owners/` is unlocked is
dead (runtime/jobs/owners.py), and its running jobs are claimed at once.
Never a job this instance holds: its lease may have lapsed while the store
was down, but its work runs here, or its outcome waits to be written.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from runtime.errors import StorageUnavailable
from runtime.jobs.job import Job
from runtime.jobs.leases import Probe
from runtime.jobs.owners import OwnerLock
from runtime.jobs.store_access import StoreAccess
from runtime.telemetry.logs import REQUEST_ID

log = logging.getLogger("thaw.jobs")


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

    def items_of(self, job_id: str) -> Any:
        """The items of the job's run started by `run_job`, as they come (an
        `ItemSource`, runtime/jobs/items.py), or None for a handler that streams none."""
        ...


# Follows a claimed job's work here, and its items (the manager's `follow`).
Follow = Callable[[Job, asyncio.Future[Any], Probe, Any], None]


class Recovery:
    """Claims lapsed jobs and dead owners' jobs, runs them through `runner`, purges expired ones."""

    def __init__(
        self,
        access: StoreAccess,
        *,
        owner: str,
        lease_s: float,
        max_attempts: int,
        held: Callable[[str], bool],
        follow: Follow,
        runner: JobRunner | None,
        owners_dir: Path | None,
    ) -> None:
        self.access = access
        self.store = access.store
        self.owner = owner
        self.lease_s = lease_s
        self.max_attempts = max_attempts
        self.held = held
        self.follow = follow
        # None (a manager on its own, in tests): jobs are claimed but not run again.
        self.runner = runner
        # This instance's lock file among its node's (None: no dead-owner recovery).
        self.owner_lock = OwnerLock(owners_dir, owner) if owners_dir is not None else None

    async def claim_and_run(self, job: Job) -> Job | None:
        """Claim a job whose lease lapsed and run it here; None if not claimed."""
        if self.held(job.id) or not self._can_run(job.handler):
            return None
        claimed: Job | None = await self.access.write(
            self.store.claim, job.id, self.owner, self.lease_s, self.max_attempts
        )
        if claimed is not None:
            self._run_recovered(claimed)
        return claimed

    def run_claimed(self, claimed: Job) -> asyncio.Future[Any] | None:
        """Run a job this instance just claimed from the fleet's queue: the future of
        its work's outcome (None: nothing runs jobs here)."""
        return self._run_recovered(claimed, what="running queued job")

    def _can_run(self, handler: str) -> bool:
        return self.runner is None or self.runner.can_run(handler)

    def _run_recovered(
        self, claimed: Job, *, what: str = "recovering job"
    ) -> asyncio.Future[Any] | None:
        if self.runner is None:
            return None
        # Its first request's id is not kept with the job: a recovered run is known by
        # the job's id (the request id its handler sees too), not by the poll or sweep
        # that claimed it.
        token = REQUEST_ID.set(claimed.id)
        try:
            log.info("%s %s (attempt %d)", what, claimed.id, claimed.attempts)
            work = self.runner.run_job(claimed)
            self.follow(claimed, work, lambda: ("running", None), self.runner.items_of(claimed.id))
            return work
        finally:
            REQUEST_ID.reset(token)

    async def sweep(self) -> int:
        """Claim and run every lapsed job; returns how many."""
        ids: list[str] = await self.access.read(self.store.lapsed, 100)
        recovered = 0
        for job_id in ids:
            job = await self.access.read(self.store.get, job_id)
            if job is not None and await self.claim_and_run(job) is not None:
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

    async def reclaim_owner(self, dead_owner: str) -> int:
        """Claim and run at once the running jobs of `dead_owner`, found dead by the
        fleet's liveness in the database (runtime/jobs/fleet.py); returns how many."""
        return await self._reclaim(dead_owner, where="in the fleet (silent in the database)")

    async def _reclaim(self, dead_owner: str, *, where: str = "on this node") -> int:
        reclaimed = 0
        seen: set[str] = set()
        access = self.access
        while True:
            ids = await access.read(self.store.owned, dead_owner, 100)
            fresh = [job_id for job_id in ids if job_id not in seen]
            if not fresh:
                break
            for job_id in fresh:
                seen.add(job_id)
                job = await access.read(self.store.get, job_id)
                if job is None or not self._can_run(job.handler):
                    continue  # left to its lease, for an instance that has its handler
                claimed = await access.write(
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
                "owner %s died %s: %d of its %d running job(s) taken at once",
                dead_owner,
                where,
                reclaimed,
                len(seen),
            )
        return reclaimed

    async def purge(self) -> int:
        """Delete expired jobs; returns how many."""
        return await self.access.write(self.store.purge_expired)

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
