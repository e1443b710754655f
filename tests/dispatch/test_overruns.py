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


async def test_a_run_watched_again_from_before_runs_watched_since_is_reported_when_due() -> None:
    """`a` is due at 10 s but found to have begun at 1 s (its call waited 1 s): watched
    again from there, it is due at 11 s, before `b` (watched from 2 s, due at 12
    s). `c`, watched again at 12 s from 3 s, is forgotten before 13 s: never told."""
    clock = ManualClock()
    reported: list[tuple[str, float]] = []
    start = clock.monotonic()

    def overran(run: str, started_at: float, call: str | None) -> None:
        if call == "waited":
            overruns.watch_again(run, started_at + 1.0, "taken")
        else:
            reported.append((run, clock.monotonic()))

    overruns: Overruns[str, str] = Overruns(10.0, overran, clock)
    overruns.watch("a", start, "waited")
    clock.advance(2.0)
    overruns.watch("b", clock.monotonic())
    overruns.watch("c", clock.monotonic(), "waited")
    clock.advance(8.0)  # 10 s: `a` watched again, from 1 s
    assert reported == [] and len(overruns) == 3
    clock.advance(1.0)
    assert reported == [("a", start + 11.0)]
    clock.advance(1.0)  # 12 s: `b` due; `c` watched again from 3 s, then forgotten
    assert len(overruns) == 1
    overruns.forget("c")
    clock.advance(5.0)
    assert reported == [("a", start + 11.0), ("b", start + 12.0)]
    assert len(overruns) == 0
