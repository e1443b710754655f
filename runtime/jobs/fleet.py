"""This instance's part in a fleet: instances sharing one store that can listen
and that holds their liveness (PostgreSQL, docs/fleet.md).

- Wake-ups (runtime/jobs/wakeups.py): the manager's long polls wake when the job
  changes on any instance, and a cancel that reached another instance stops
  the work here at once (the manager subscribes to the events).
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

from runtime.errors import StorageUnavailable
from runtime.jobs.liveness import Liveness, Pinger, has_owners_table
from runtime.jobs.manager import JobManager

log = logging.getLogger("thaw.jobs")

PING_S = 1.0
DEAD_AFTER_S = 5.0


class Fleet:
    def __init__(
        self, jobs: JobManager, *, ping_s: float = PING_S, dead_after_s: float = DEAD_AFTER_S
    ) -> None:
        self.jobs = jobs
        self.ping_s = ping_s
        self.dead_after_s = dead_after_s
        self.liveness: Liveness | None = None
        self._pinger: Pinger | None = None

    def start(self, store: object) -> bool:
        """Join the fleet of `store` (the opened store), on the running loop; False
        when the store is not one a fleet shares."""
        self.jobs.wakeups.start(store)
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

    async def judge(self) -> None:
        """Every `ping_s`: take the running jobs of owners found dead (a background task)."""
        liveness = self.liveness
        if liveness is None:
            return
        clock = self.jobs.clock
        while True:
            await clock.sleep(self.ping_s)
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

    def close(self) -> None:
        if self._pinger is not None:
            self._pinger.stop()
        self.jobs.wakeups.close()
