"""The instance's two clocks: one monotonic, one wall, and timers on the first.

Every component that reads time takes the one `Clock` that `Instance.create`
makes (durations, deadlines, leases and back-offs on `monotonic()`; the
`*_at` fields of records on `wall()`), and arms its timers through it, so a
deadline computed from `monotonic()` is also waited for on `monotonic()`.
Tests pass a `ManualClock` and move time with `advance()`: leases lapse,
deadlines pass and timeouts fire in order, with no sleep and nothing that
depends on how busy the machine is.

`monotonic` and `wall` are attributes holding plain functions (the system's
`time.monotonic` and `time.time`), not methods: the warm path reads the
clock several times per request, and a bound builtin costs no Python frame.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Any, Protocol

# The last whole second `utc_second` wrote and its text, as one tuple: the log
# lines and the job times of one second share it, and threads at a second's turn
# never pair one second's number with another's text.
_second: tuple[int, str] = (-1, "")


def utc_second(whole: int) -> str:
    """Epoch second `whole` as ISO 8601 UTC, "YYYY-MM-DDTHH:MM:SS" (the last one kept)."""
    global _second
    second = _second
    if second[0] != whole:
        second = _second = (whole, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)))
    return second[1]


class Timer(Protocol):
    """A callback armed on a clock; `asyncio.TimerHandle` is one."""

    def cancel(self) -> None: ...

    def when(self) -> float: ...


class Clock:
    """The system clocks: `time.monotonic` and `time.time`; timers on the running loop.

    The default event loop's own clock is `time.monotonic()`, so a timer armed
    at a monotonic time is a plain `loop.call_at`.
    """

    __slots__ = ("monotonic", "wall")

    def __init__(
        self,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.monotonic = monotonic
        self.wall = wall

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer:
        """Run `callback` on the running loop at `when` (on `monotonic()`)."""
        loop = asyncio.get_running_loop()
        return loop.call_at(loop.time() + (when - self.monotonic()), callback)

    def call_later(self, delay_s: float, callback: Callable[[], object]) -> Timer:
        return self.call_at(self.monotonic() + delay_s, callback)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def wait_until(self, future: asyncio.Future[Any], when: float) -> bool:
        """Wait for `future` until `when` at the latest (it is not cancelled); True if done."""
        if future.done() or when <= self.monotonic():
            return future.done()
        waker: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake(_: object = None) -> None:
            if not waker.done():
                waker.set_result(None)

        timer = self.call_at(when, wake)
        future.add_done_callback(wake)
        try:
            await waker
        finally:
            timer.cancel()
            future.remove_done_callback(wake)
        return future.done()


SYSTEM = Clock()


class _ManualTimer:
    __slots__ = ("_callback", "_when", "cancelled")

    def __init__(self, when: float, callback: Callable[[], object]) -> None:
        self._when = when
        self._callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def when(self) -> float:
        return self._when


class ManualClock(Clock):
    """A clock that moves only when told (`advance`), for tests.

    Timers armed on it fire, in order of their times, inside `advance`; a
    `sleep` returns once the clock has been advanced past its end. Both
    readings move together: `wall()` is `monotonic()` plus a fixed offset.
    """

    __slots__ = ("_heap", "_now", "_order", "_wall_offset")

    def __init__(self, start: float = 1000.0, wall_start: float = 1_800_000_000.0) -> None:
        self._now = start
        self._wall_offset = wall_start - start
        self._heap: list[tuple[float, int, _ManualTimer]] = []
        self._order = itertools.count()
        super().__init__(self._monotonic, self._wall)

    def _monotonic(self) -> float:
        return self._now

    def _wall(self) -> float:
        return self._now + self._wall_offset

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer:
        timer = _ManualTimer(when, callback)
        heapq.heappush(self._heap, (when, next(self._order), timer))
        return timer

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            # Due now: no advance is needed (nor would one come) to end it.
            await asyncio.sleep(0)
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not done.done():
                done.set_result(None)

        self.call_at(self._now + seconds, wake)
        await done

    @property
    def pending(self) -> int:
        """Timers armed and not cancelled (not yet due)."""
        return sum(1 for _, _, timer in self._heap if not timer.cancelled)

    def advance(self, seconds: float) -> None:
        """Move time forward by `seconds`, firing every timer due on the way, in order."""
        if seconds < 0:
            raise ValueError("a clock never goes back")
        end = self._now + seconds
        while self._heap and self._heap[0][0] <= end:
            when, _, timer = heapq.heappop(self._heap)
            if timer.cancelled:
                continue
            self._now = max(self._now, when)
            timer._callback()
        self._now = end
