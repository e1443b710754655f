"""Handler runs past `THAW_RUN_TIMEOUT_S`, found with one loop timer for all.

Every run is watched from the moment its handler starts until its work ends.
All runs have the same limit, so the oldest run is the first to overrun: the
runs are kept in start order (a dict), and one timer is armed for the oldest.
A run that ends leaves the dict; the timer, when it fires, finds what is due
and is armed again for the oldest run left. Per run that costs a dict insert
and a delete, not a timer handle (see deadlines.py for why that matters on the
warm path).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from runtime.clock import Clock, Timer

T = TypeVar("T")


class Overruns(Generic[T]):
    """Calls `on_overrun(run)` for each watched run still going `limit_s` after it began."""

    def __init__(self, limit_s: float, on_overrun: Callable[[T], None], clock: Clock) -> None:
        self.limit_s = limit_s
        self._on_overrun = on_overrun
        self._clock = clock
        self._running: dict[T, float] = {}
        self._timer: Timer | None = None

    def __len__(self) -> int:
        return len(self._running)

    def watch(self, run: T, started_at: float) -> None:
        """Watch `run`, begun at `started_at` (on the clock's `monotonic()`)."""
        self._running[run] = started_at + self.limit_s
        if self._timer is None:
            self._arm(started_at + self.limit_s)

    def forget(self, run: T) -> None:
        self._running.pop(run, None)

    def _arm(self, at: float) -> None:
        self._timer = self._clock.call_at(at, self._fire)

    def _fire(self) -> None:
        self._timer = None
        now = self._clock.monotonic()
        due = []
        for run, at in self._running.items():
            if at > now:
                self._arm(at)
                break
            due.append(run)
        for run in due:
            del self._running[run]
            self._on_overrun(run)
