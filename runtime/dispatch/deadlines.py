"""Waking waiting requests at their deadlines, with one timer for all.

A timer per request (`loop.call_later`, then `cancel` when the work finishes
first) was a large share of the runtime's own cost per warm sync request:
each builds a handle, pushes it on the loop's heap, and leaves it there
cancelled until the deadline passes. Here a waiter is one dict entry, and one timer is
armed for the earliest deadline. A waiter that leaves early does not move the
timer: it fires, finds nothing due, and is armed again for the earliest
deadline left; with every request given the same wait, deadlines only grow,
so that is rare.

Deadlines are on the instance's clock (`Clock.monotonic()`, as
`Context.deadline_at` is), and the timer is armed through that same clock, so
a deadline is waited for on the clock it was computed on.
"""

from __future__ import annotations

import asyncio
import math

from runtime.clock import Clock, Timer


class Deadlines:
    """Futures settled (result None) at their deadline unless settled first."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._waiting: dict[asyncio.Future[None], float] = {}
        self._timer: Timer | None = None
        # When the timer is due (inf: none armed), on the clock's `monotonic()`.
        self._timer_at = math.inf

    def __len__(self) -> int:
        return len(self._waiting)

    async def wait(self, settled: asyncio.Future[None], deadline_at: float) -> None:
        """Wait for `settled`, settling it at `deadline_at` (the clock's `monotonic()`)
        at the latest."""
        if settled.done():
            return
        self._waiting[settled] = deadline_at
        if deadline_at < self._timer_at:
            self._arm(deadline_at)
        try:
            await settled
        finally:
            del self._waiting[settled]

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = self._clock.call_at(at, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._timer_at = math.inf
        now = self._clock.monotonic()
        earliest: float | None = None
        for settled, at in self._waiting.items():
            if at <= now:
                if not settled.done():
                    settled.set_result(None)
            elif earliest is None or at < earliest:
                earliest = at
        if earliest is not None:
            self._arm(earliest)
