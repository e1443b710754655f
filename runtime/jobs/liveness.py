"""Liveness held in the database: which instances of a fleet are dead.

Each instance writes `ping(owner)` (`thaw_owners.seen_at`) every `ping_s`. An
owner silent for `dead_after_s` that still holds running jobs is dead, and
another instance takes those jobs at once (`claim_orphan`) instead of waiting
for their leases. Across machines there is no lock file to prove a death
(runtime/jobs/owners.py does that on one node), so silence is the proof, and
two rules keep it from convicting a living owner:

- An observer judges only after its own pings have succeeded without a break
  for `dead_after_s`: the database has then been writable long enough for
  every living owner to have pinged too. After an outage (PostgreSQL
  restarted, this instance cut off) nobody is judged until that much time has
  passed again, so a fleet coming back does not take each other's jobs.
- A presumed-dead owner that was only cut off is fenced: its claim's
  `attempt` no longer matches, so its late heartbeat, phase or finish changes
  nothing (docs/fleet.md, "Claims, fencing and time").

Times are `clock.wall()` of each instance (the rows compare instance clocks,
as leases do): keep them synchronized.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from runtime.clock import Clock
from runtime.errors import StorageUnavailable

log = logging.getLogger("thaw.jobs")


class OwnersTable(Protocol):
    """What liveness needs of a store (the PostgreSQL store has it)."""

    def ping(self, owner: str) -> None: ...

    def silent_owners(self, before: float, limit: int = 100) -> list[str]: ...


def has_owners_table(store: object) -> bool:
    return callable(getattr(store, "silent_owners", None))


class Liveness:
    """This instance's pings, and the owners it may take to be dead. Blocking calls
    (store I/O): run them in a worker thread."""

    def __init__(
        self,
        store: OwnersTable,
        *,
        owner: str,
        clock: Clock,
        ping_s: float = 1.0,
        dead_after_s: float = 5.0,
    ) -> None:
        if dead_after_s <= 2 * ping_s:
            raise ValueError("dead_after_s must leave room for at least two missed pings")
        self.store = store
        self.owner = owner
        self.clock = clock
        self.ping_s = ping_s
        self.dead_after_s = dead_after_s
        # Wall time of the first ping of the current unbroken run of good ones.
        self._since: float | None = None
        self._last: float | None = None
        # The last ping's failure, None once one succeeds: how the event loop learns
        # that the store went away even when no request touches it.
        self.failure: StorageUnavailable | None = None

    def beat(self) -> None:
        """Ping; a failure (StorageUnavailable, raised) breaks the run of good pings."""
        try:
            self.store.ping(self.owner)
        except StorageUnavailable as exc:
            self._since = None
            self.failure = exc
            raise
        self.failure = None
        now = self.clock.wall()
        if self._since is None or self._last is None or now - self._last > self.dead_after_s:
            # Pings further apart than a death's silence (this process was stopped,
            # or its loop starved): others may have judged this one meanwhile, and it
            # must not judge them on a run it did not keep up.
            self._since = now
        self._last = now

    @property
    def judging(self) -> bool:
        """Whether this instance's own pings have held long enough to judge others."""
        return self._since is not None and self.clock.wall() - self._since >= self.dead_after_s

    def dead(self, limit: int = 100) -> list[str]:
        """Owners silent for `dead_after_s` that hold running jobs; [] while not `judging`."""
        if not self.judging:
            return []
        before = self.clock.wall() - self.dead_after_s
        return [o for o in self.store.silent_owners(before, limit) if o != self.owner]


class Pinger:
    """`liveness.beat()` every `ping_s` from a thread of its own.

    Not on the event loop: a loop held up for seconds (a burst of work, a slow
    import holding the GIL in bursts) must not make a living instance look dead
    to the others. The interval is real time, like the process's own life.
    """

    def __init__(self, liveness: Liveness) -> None:
        self.liveness = liveness
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="thaw-liveness", daemon=True)

    def start(self) -> Pinger:
        self._thread.start()
        return self

    def _run(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                self.liveness.beat()
                failing = False
            except StorageUnavailable:
                failing = True  # the store's health condition says so already
            except Exception:
                if not failing:
                    log.exception("liveness ping failed")
                failing = True
            self._stop.wait(self.liveness.ping_s)

    def stop(self) -> None:
        self._stop.set()
