"""`one_at_a_time`: a handler declared to run one call at a time, held until the test lets it end.

Declared `batch=Batch(max_size=1, max_wait_ms=0, max_concurrent=1)`: a GPU that
holds one batch, code that is not thread-safe. Each call is an `async def` that
waits on a future of its own in `RUNS.open` (by the event's `id`), so the test
ends runs one by one (`RUNS.finish(id)`) and the order of events, never timing,
decides what overlaps. `RUNS` counts the calls running now, the most that ever
ran at once (`peak`), and every id started, in order.
"""

from __future__ import annotations

import asyncio
from typing import Any

from runtime import Batch, Context, handler


class Runs:
    """What the handler's calls did, for the test to read (reset per test)."""

    def __init__(self) -> None:
        self.running = 0
        self.peak = 0
        self.started: list[Any] = []
        self.open: dict[Any, asyncio.Future[None]] = {}

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    def finish(self, run_id: Any) -> None:
        """Let run `run_id` end (it returns its output at its next loop turn)."""
        waiter = self.open.pop(run_id)
        if not waiter.done():
            waiter.set_result(None)

    def finish_all(self) -> None:
        for run_id in list(self.open):
            self.finish(run_id)


RUNS = Runs()


@handler("one_at_a_time", batch=Batch(max_size=1, max_wait_ms=0, max_concurrent=1))
async def one_at_a_time(events: list[Any], ctxs: list[Context]) -> list[Any]:
    [event] = events
    run_id = event.get("id") if isinstance(event, dict) else None
    RUNS.running += 1
    RUNS.peak = max(RUNS.peak, RUNS.running)
    RUNS.started.append(run_id)
    waiter = RUNS.open[run_id] = asyncio.get_running_loop().create_future()
    try:
        await waiter
    finally:
        RUNS.running -= 1
        RUNS.open.pop(run_id, None)
    return [{"id": run_id}]
