"""This instance's part in a fleet: instances sharing one store that can listen
and that holds their liveness (PostgreSQL, docs/fleet.md).

- Wake-ups (runtime/jobs/wakeups.py): the manager's long polls wake when the job
  changes on any instance, and a cancel that reached another instance stops
  the work here at once (the manager subscribes to the events).
- Shared queue and items: with such a store the manager records jobs this
  instance cannot start soon as queued (`shared_queue`, runtime/dispatch/
  claims.py), and writes streaming jobs' items for followers anywhere
  (`items.store`, runtime/jobs/items.py).
- Queued work (`take_queued`): while this instance is idle, it claims the
  fleet's oldest queued job (`claim_next`, rows others hold skipped) and runs
  it: first of the handlers whose models are READY here, and of the others
  only once a job has waited `cold_wait_s` (a cold instance would add a load
  to the job's wait, a warm one may take it meanwhile). Woken by a `queued`
  notification, as soon as this instance is idle again after work of its own
  (a backlog queued while it was busy sends no new notification), and every
  `recheck_s` all the same (jobs queued before this instance listened,
  notifications lost in a gap).
- Liveness (runtime/jobs/liveness.py): this instance pings `thaw_owners` every
  `ping_s` from a thread of its own; every `ping_s` it also asks which owners
  have been silent for `dead_after_s` while holding running jobs, and takes
  their jobs at once (`claim_orphan`, fenced: the dead owner's late writes are
  refused), instead of waiting for their leases to lapse.

A store without these (SQLite, DynamoDB) starts nothing here: one node's dead
owners are found by their lock files, other nodes' by their leases.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from runtime.errors import StorageUnavailable
from runtime.jobs.job import Job
from runtime.jobs.liveness import Liveness, Pinger, has_owners_table
from runtime.jobs.manager import JobManager
from runtime.jobs.wakeups import Event

log = logging.getLogger("thaw.jobs")

PING_S = 1.0
DEAD_AFTER_S = 5.0
# How long a queued job waits for a warm instance before a cold one takes it.
COLD_WAIT_S = 10.0
RECHECK_S = 5.0
# How often a busy instance looks whether it is idle again, to claim the fleet's
# backlog as soon as it frees (a local check: no query while busy).
BUSY_RECHECK_S = 0.05


class Work(Protocol):
    """What taking queued work asks of this instance (the Instance wires it)."""

    def idle(self) -> bool:
        """Whether this instance has nothing in flight and is not draining."""
        ...

    def draining(self) -> bool:
        """Whether this instance is draining (it takes no one's jobs then)."""
        ...

    def handlers(self) -> Sequence[str]:
        """The handlers this instance serves."""
        ...

    def warm(self, handler: str) -> bool:
        """Whether `handler`'s models are READY here (True for one without models)."""
        ...


class Fleet:
    def __init__(
        self, jobs: JobManager, *, ping_s: float = PING_S, dead_after_s: float = DEAD_AFTER_S
    ) -> None:
        self.jobs = jobs
        self.ping_s = ping_s
        self.dead_after_s = dead_after_s
        self.liveness: Liveness | None = None
        self._pinger: Pinger | None = None
        self._store: object = None
        self._queued = asyncio.Event()
        jobs.wakeups.subscribe(self._on_event)

    def start(self, store: object) -> bool:
        """Join the fleet of `store` (the opened store), on the running loop; False
        when the store is not one a fleet shares."""
        self.jobs.wakeups.start(store)
        self._store = store
        self.jobs.shared_queue = self.jobs.wakeups.supported and hasattr(store, "claim_next")
        if self.jobs.wakeups.supported and hasattr(store, "items_after"):
            self.jobs.items.store = store
        if not has_owners_table(store):
            return self.jobs.wakeups.supported
        self.liveness = Liveness(
            store,  # type: ignore[arg-type]
            owner=self.jobs.owner,
            clock=self.jobs.clock,
            ping_s=self.ping_s,
            dead_after_s=self.dead_after_s,
        )
        self._pinger = Pinger(self.liveness).start()
        return True

    async def judge(self, work: Work) -> None:
        """Every `ping_s`: take the running jobs of owners found dead, unless draining
        (a background task)."""
        liveness = self.liveness
        if liveness is None:
            return
        clock = self.jobs.clock
        while True:
            await clock.sleep(self.ping_s)
            failure = liveness.failure
            if failure is not None:
                # Readiness off now (the health condition, and its probe that turns it
                # back on), not at the next request or maintenance pass.
                self.jobs.access.failing(failure)
                continue
            if work.draining():
                continue  # the others take them: this instance is about to exit
            try:
                dead = await asyncio.to_thread(liveness.dead)
                for owner in dead:
                    log.warning(
                        "owner %s silent for over %.0f s with running jobs: taking them",
                        owner,
                        self.dead_after_s,
                    )
                    await self.jobs.recovery.reclaim_owner(owner)
            except StorageUnavailable:
                continue
            except Exception:
                log.exception("taking the jobs of dead owners failed")

    def _on_event(self, event: Event | None) -> None:
        if event is None or event.status == "queued":
            self._queued.set()

    async def take_queued(
        self,
        work: Work,
        *,
        cold_wait_s: float = COLD_WAIT_S,
        recheck_s: float = RECHECK_S,
        busy_recheck_s: float = BUSY_RECHECK_S,
    ) -> None:
        """While idle, claim and run the fleet's queued jobs (a background task)."""
        claim_next = getattr(self._store, "claim_next", None)
        if claim_next is None:
            return
        jobs, clock = self.jobs, self.jobs.clock
        while True:
            self._queued.clear()
            try:
                while work.idle():
                    claimed = await asyncio.to_thread(self._claim, claim_next, work, cold_wait_s)
                    if claimed is None:
                        break
                    # One of this instance's own jobs, recorded queued as it looked,
                    # is taken back: its work waits here already (never run twice).
                    if jobs.leases.take_back(claimed):
                        continue
                    outcome = jobs.recovery.run_claimed(claimed)
                    if outcome is not None:
                        # One claimed job at a time: another is claimed once this one
                        # has ended, whenever its work counts as in flight here.
                        await asyncio.wait([outcome])
            except StorageUnavailable:
                pass
            except Exception:
                log.exception("taking queued jobs failed")
            if not work.idle():
                # Busy: nothing can be claimed, and no notification will come for the
                # backlog queued already, so look again as soon as the work here may
                # have ended (a cheap local check), not a recheck later.
                await clock.sleep(busy_recheck_s)
                continue
            waiter = asyncio.ensure_future(self._queued.wait())
            try:
                await clock.wait_until(waiter, clock.monotonic() + recheck_s)
            finally:
                waiter.cancel()

    def _claim(
        self, claim_next: Callable[..., Job | None], work: Work, cold_wait_s: float
    ) -> Job | None:
        """The oldest queued job of a warm handler; else of a cold one, once it waited."""
        jobs = self.jobs
        names = list(work.handlers())
        warm = [name for name in names if work.warm(name)]
        cold = [name for name in names if name not in warm]
        if warm:
            claimed = claim_next(jobs.owner, jobs.lease_s, jobs.max_attempts, warm)
            if claimed is not None:
                return claimed
        if not cold:
            return None
        before = jobs.clock.wall() - cold_wait_s
        return claim_next(jobs.owner, jobs.lease_s, jobs.max_attempts, cold, queued_before=before)

    def close(self) -> None:
        if self._pinger is not None:
            self._pinger.stop()
        self.jobs.wakeups.close()
