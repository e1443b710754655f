"""An event loop whose clock moves only when the loop would otherwise sleep.

The loop's clock (`loop.time()`) is the seam every runtime timer goes through
(`call_at`, `call_later`, `asyncio.sleep`). Here it starts at an arbitrary
point and jumps straight to the next timer whenever nothing is ready, so a
test of timers asserts *when* (in loop time) each thing happened, exactly,
and takes no wall-clock time doing it: nothing depends on how busy the
machine is.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _Selector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """Polls; where the loop asks to sleep `timeout`, moves its clock instead."""

    def __init__(self, loop: VirtualClockLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[Any, int]]:
        ready: list[tuple[Any, int]] = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # no timer at all: only real I/O can wake the loop
            return super().select(None)  # type: ignore[no-any-return]
        self._loop.now += timeout
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self.now = 1000.0
        super().__init__(_Selector(self))

    def time(self) -> float:
        return self.now


def run(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on a VirtualClockLoop."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()
