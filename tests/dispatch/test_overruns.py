"""Run limits with one timer for all runs, on the clock they are given.

On a `ManualClock`: each run is reported at the exact time it passes its limit,
in start order, with its start and what it was watched with, and a run that
ended first is never reported.
"""

from __future__ import annotations

import pytest

from runtime.clock import ManualClock
from runtime.dispatch.overruns import Overruns

pytestmark = pytest.mark.anyio


async def test_each_run_is_reported_when_it_passes_its_limit_in_start_order() -> None:
    clock = ManualClock()
    reported: list[tuple[str, float]] = []
    overruns: Overruns[str, str] = Overruns(
        2.0, lambda run, started_at, call: reported.append((run, clock.monotonic())), clock
    )
    start = clock.monotonic()
    overruns.watch("a", start)
    clock.advance(0.5)
    overruns.watch("b", clock.monotonic())
    clock.advance(1.0)
    overruns.watch("c", clock.monotonic())
    assert clock.pending == 1, "one timer for every run"
    clock.advance(0.4999)
    assert reported == []
    clock.advance(5.0)
    assert reported == [("a", start + 2.0), ("b", start + 2.5), ("c", start + 3.5)]
    assert len(overruns) == 0 and clock.pending == 0


async def test_a_run_that_ended_is_not_reported_and_the_next_one_still_is() -> None:
    clock = ManualClock()
    reported: list[tuple[str, float, str | None]] = []
    overruns: Overruns[str, str] = Overruns(1.0, lambda *overran: reported.append(overran), clock)
    overruns.watch("done", clock.monotonic())
    clock.advance(0.5)
    slow_at = clock.monotonic()
    overruns.watch("slow", slow_at, "its call")
    overruns.forget("done")
    clock.advance(0.5)  # the timer armed for "done" fires, finds nothing due, re-arms
    assert reported == []
    clock.advance(0.5)
    assert reported == [("slow", slow_at, "its call")]
    assert len(overruns) == 0
