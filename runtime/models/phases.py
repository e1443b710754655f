"""Watching a load's phases: no progress, no end.

Each phase of a load (fetch, load, init, each warm-up example) fails with
`load-failed`, naming the phase, once it has made no progress for
`PhaseLimits.stall_s` (fetch and load progress is bytes arriving), or at once
when the load is abandoned (an unload). A builder or warm-up left running in
its thread cannot be stopped and keeps what it holds, so a stall there wedges
the instance (runtime/telemetry/health.py): it drains and exits for the
platform to replace it.

The wedge follows the load's failure, never the other way round: it is declared
once the failed load has ended (its clean-up included) and every request
waiting on it has taken its `load-failed`. A drain begun at the stall would race
that clean-up, and, its grace over first, answer those requests `drained`
instead of why their load failed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from runtime.clock import Clock
from runtime.errors import LoadFailed
from runtime.models.entry import Entry
from runtime.models.weights import host, teams
from runtime.telemetry.health import Health

T = TypeVar("T")

# Phases whose stall leaves user code running in a thread that cannot be stopped.
_USER_CODE_PHASES = frozenset({"init", "warmup"})


@dataclass(frozen=True)
class PhaseLimits:
    # A load phase that makes no progress for this long fails (THAW_PHASE_STALL_S).
    stall_s: float = 300.0


class PhaseWatch:
    """Runs a load's steps under the stall bound and the entry's abandonment."""

    def __init__(self, limits: PhaseLimits, health: Health, clock: Clock) -> None:
        self.limits = limits
        self.health = health
        self.clock = clock
        # Bundles whose stalled phase left user code running: the wedge's detail,
        # declared when their load has ended (`load_ended`).
        self._stuck: dict[str, str] = {}
        # Wedges waiting for the failure to reach the load's waiters (held: the
        # loop keeps only weak references to tasks).
        self._wedging: set[asyncio.Task[None]] = set()

    async def watch(self, entry: Entry, phase: str, work: Awaitable[T], *, stall: bool = True) -> T:
        """`work`'s result, unless the load is abandoned or (with `stall`) `work`
        makes no progress for `stall_s` first; then LoadFailed naming `phase`."""
        future = asyncio.ensure_future(work)
        abort = entry.abort
        assert abort is not None
        clock = self.clock
        entry.progress_at = clock.monotonic()
        stall_s = self.limits.stall_s
        # Settled by whichever of the work and the abandonment ends first.
        first: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def settle(_: object) -> None:
            if not first.done():
                first.set_result(None)

        future.add_done_callback(settle)
        abort.add_done_callback(settle)
        try:
            while True:
                due = entry.progress_at + stall_s
                if stall and due <= clock.monotonic():
                    future.cancel()  # a thread goes on; a coroutine (warm-up, memory wait) stops
                    if phase in _USER_CODE_PHASES:
                        self._stuck[entry.name] = (
                            f"{phase} of bundle {entry.name!r} made no progress for {stall_s:g} s"
                        )
                    raise LoadFailed(
                        f"bundle {entry.name!r}: {phase} made no progress for {stall_s:g} s "
                        f"(THAW_PHASE_STALL_S)",
                        phase=phase,
                    )
                if stall:
                    # Woken at the stall deadline as it stood: progress since moves it.
                    await clock.wait_until(first, due)
                else:
                    await first
                if future.done():
                    return future.result()
                if abort.done():
                    future.cancel()
                    abort.result()  # raises the abandonment's LoadFailed
        finally:
            # The abandonment future outlives this phase: leave no callback on it.
            abort.remove_done_callback(settle)

    def load_ended(self, entry: Entry) -> None:
        """Called last by `entry`'s load task: if a stall left user code running,
        the instance wedges once that task has ended and its waiters have its failure."""
        detail = self._stuck.pop(entry.name, None)
        if detail is None:
            return
        load = asyncio.current_task()
        assert load is not None
        wedging = asyncio.get_running_loop().create_task(self._wedge_after(entry, load, detail))
        self._wedging.add(wedging)
        wedging.add_done_callback(self._wedging.discard)

    async def _wedge_after(self, entry: Entry, load: asyncio.Task[Any], detail: str) -> None:
        await asyncio.wait({load})
        # Each waiter (runtime/models/cache.py, `acquire`) is woken by the load's end
        # and takes its failure within the loop's next turns; a new load of the
        # bundle (none begins before the back-off) has waiters of its own.
        while entry.waiting and entry.task is None:
            await asyncio.sleep(0)
        self.health.wedge(detail)

    async def in_thread(self, entry: Entry, phase: str, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a worker thread, in the bundle's memory window, watched."""
        loop = asyncio.get_running_loop()
        thread = loop.run_in_executor(None, teams.released_after, host.within_window, fn, *args)
        return await self.watch(entry, phase, thread)
