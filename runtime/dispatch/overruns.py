"""Runs past `THAW_RUN_TIMEOUT_S`, found with one loop timer for all: the
executor's watch (executor.py), which runs user code and times it.

Every run is watched from the moment its call is handed to the executor until
its work ends. All runs have the same limit, so the oldest run is the first to
overrun: the runs are kept in start order (a dict), and one timer is armed for
the oldest. A run that ends leaves the dict; the timer, when it fires, finds
what is due and is armed again for the oldest run left. Per run that costs a
dict insert and a delete, not a timer handle (see deadlines.py for why that
matters on the warm path).

Each run is kept with its start and what its watcher needs to look at it again
when it is due (the executor: the future of a sync call, which may have waited
for a handler thread, and then counts from when one took it). A run found not
due after all is watched again from a later start (`watch_again`), which may
be before the starts of runs watched since: out of start order, it gets a
timer of its own, so it is reported when it is due, not when they are.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Generic, TypeVar

from runtime.clock import Clock, Timer

T = TypeVar("T")
C = TypeVar("C")


class Overruns(Generic[T, C]):
    """Calls `on_overrun(run, started_at, call)` for each watched run still going
    `limit_s` after it began, and forgets it: watched again only if it says so."""

    def __init__(
        self,
        limit_s: float,
        on_overrun: Callable[[T, float, C | None], None],
        clock: Clock,
    ) -> None:
        self.limit_s = limit_s
        self._on_overrun = on_overrun
        self._clock = clock
        self._running: dict[T, tuple[float, C | None]] = {}
        self._timer: Timer | None = None

    def __len__(self) -> int:
        return len(self._running)

    def watch(self, run: T, started_at: float, call: C | None = None) -> None:
        """Watch `run`, begun at `started_at` (on the clock's `monotonic()`); `call`
        comes back with it when it is due."""
        self._running[run] = (started_at, call)
        if self._timer is None:
            self._arm(started_at + self.limit_s)

    def watch_again(self, run: T, started_at: float, call: C | None = None) -> None:
        """Watch `run` (reported, and found not due after all) again from `started_at`,
        which may be before the starts of runs watched since: with a timer of its
        own (only this rare path arms one per run)."""
        entry = (started_at, call)
        self._running[run] = entry
        self._clock.call_at(started_at + self.limit_s, partial(self._fire_one, run, entry))

    def forget(self, run: T) -> None:
        self._running.pop(run, None)

    def _arm(self, at: float) -> None:
        self._timer = self._clock.call_at(at, self._fire)

    def _fire(self) -> None:
        self._timer = None
        limit_s = self.limit_s
        now = self._clock.monotonic()
        due = []
        for run, entry in self._running.items():
            at = entry[0] + limit_s  # as `watch` armed it: the same sum, the same float
            if at > now:
                self._arm(at)
                break
            due.append((run, entry))
        for run, (started_at, call) in due:
            del self._running[run]
            self._on_overrun(run, started_at, call)

    def _fire_one(self, run: T, entry: tuple[float, C | None]) -> None:
        # A run watched again: due now, unless it was forgotten (or reported already:
        # `_fire` reports whatever is due when it comes to it).
        if self._running.get(run) is entry:
            del self._running[run]
            self._on_overrun(run, *entry)
