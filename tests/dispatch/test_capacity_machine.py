"""Capacity is a promise, as a property: whatever arrives and whenever.

A Hypothesis state machine over one in-process instance (SQLite store, the
manual clock) serving `one_at_a_time` (tests/handlers/one_at_a_time.py: a
handler declared `max_concurrent=1`, each run held until the machine ends
it). Its rules are arrivals (sync callers with deadlines, jobs, streams),
completions of the running call, cancels of jobs, a streaming client going
away, the clock moving past deadlines, and a drain's cut-off. After every step:

- at most one call of the handler runs (its declared capacity);
- no invocation has run twice (a sync caller answered 202 runs at most once);
- every invocation admitted and not yet ended holds its queue slot, and no
  slot is given back twice (the workload never go below zero).

At the end every run is let finish: every invocation is settled exactly once
(its caller answered or its job final, the queue slots all given back, nothing
in flight).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from runtime.clock import ManualClock
from runtime.dispatch.answers import JOB_NOW, STREAM
from runtime.instance import Instance
from runtime.registry import discover
from tests.handlers.one_at_a_time import RUNS
from tests.inproc import settings_for

HANDLER = "one_at_a_time"
# Which job or stream a rule acts on. Whether a call has started, answered 202 or
# opened its stream yet depends on the store's threads, not only on the steps, so
# neither a precondition nor a strategy may read that state: Hypothesis replays a
# case by its draws and calls it flaky when they differ. A rule with nothing to act
# on does nothing.
PICK = st.integers(min_value=0, max_value=63)


class CapacityMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        RUNS.reset()
        self.loop = asyncio.new_event_loop()
        self.root = Path(tempfile.mkdtemp(prefix="thaw-capacity-"))
        self.clock = ManualClock()
        config = settings_for(self.root, handlers=("tests.handlers.one_at_a_time",))
        self.instance = Instance.create(config, discover(config.handlers), clock=self.clock)
        self.run(self.instance.start())
        self.count = 0
        # Sync callers and streams waiting for their answer, by id.
        self.calls: dict[str, asyncio.Task[Any]] = {}
        # Every job id (a job asked for, or a sync caller's 202).
        self.jobs: list[str] = []
        self.streams: list[Any] = []
        self.cut_off = False

    # ---- driving the loop ---------------------------------------------------------

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def spin(self, until: Callable[[], bool] | None = None) -> None:
        """Let the loop (and the store's threads) run: until `until()` or a few turns."""

        async def turns() -> None:
            for _ in range(5000 if until else 20):
                if until is not None and until():
                    return
                await asyncio.sleep(0.001 if until else 0)
            if until is not None:
                raise AssertionError("never settled")

        self.run(turns())

    def next_id(self, kind: str) -> str:
        self.count += 1
        return f"{kind}-{self.count}"

    def collect(self) -> None:
        for run_id, task in list(self.calls.items()):
            if task.done():
                del self.calls[run_id]
                if not task.cancelled() and task.exception() is None:
                    answer = task.result()
                    if answer.job is not None:
                        self.jobs.append(answer.job.id)
                    elif answer.stream is not None:
                        self.streams.append(answer.stream)

    # ---- rules --------------------------------------------------------------------

    @rule(wait_s=st.sampled_from([0.2, 1.0, 3.0, 30.0]))
    def sync_call(self, wait_s: float) -> None:
        run_id = self.next_id("sync")
        self.calls[run_id] = self.loop.create_task(
            self.instance.invoke(HANDLER, {"id": run_id}, wait_s=wait_s, request_id=run_id)
        )
        self.spin()

    @rule()
    def stream_call(self) -> None:
        run_id = self.next_id("stream")
        self.calls[run_id] = self.loop.create_task(
            self.instance.invoke(
                HANDLER, {"id": run_id}, wait_s=5.0, request_id=run_id, policy=STREAM
            )
        )
        self.spin()

    @rule()
    def job(self) -> None:
        run_id = self.next_id("job")
        invoked = self.instance.invoke(HANDLER, {"id": run_id}, policy=JOB_NOW, request_id=run_id)
        answer = self.run(invoked)
        self.jobs.append(answer.job.id)
        self.spin()

    @rule()
    def finish_running(self) -> None:
        for run_id in list(RUNS.open)[:1]:
            RUNS.finish(run_id)
        self.spin()

    @rule(seconds=st.sampled_from([0.05, 0.5, 1.0, 5.0, 20.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.spin()

    @rule(pick=PICK)
    def cancel_job(self, pick: int) -> None:
        self.collect()
        if self.jobs:
            job_id = self.jobs[pick % len(self.jobs)]
            self.run(self.instance.cancel_job(job_id, key_id=None))
        self.spin()

    @rule(pick=PICK)
    def stream_client_goes(self, pick: int) -> None:
        self.collect()
        if self.streams:
            self.streams[pick % len(self.streams)].close()
        self.spin()

    @precondition(lambda self: not self.cut_off)
    @rule()
    def drain_cuts_off(self) -> None:
        """The end of a drain's grace: everything in flight is cut off (once)."""
        self.cut_off = True
        self.instance.dispatcher.abort_in_flight()
        self.spin()

    # ---- what holds after every step ------------------------------------------------

    @invariant()
    def within_capacity(self) -> None:
        assert RUNS.running <= 1 and RUNS.peak <= 1, RUNS.started

    @invariant()
    def nothing_ran_twice(self) -> None:
        assert len(RUNS.started) == len(set(RUNS.started)), RUNS.started

    @invariant()
    def slots_never_below_zero(self) -> None:
        self.collect()
        assert self.instance.dispatcher.pending[HANDLER] >= 0

    def teardown(self) -> None:
        try:
            dispatcher = self.instance.dispatcher

            def quiet() -> bool:
                RUNS.finish_all()
                self.collect()
                return (
                    not self.calls
                    and not dispatcher.in_flight
                    and dispatcher.pending[HANDLER] == 0
                    and not self.instance.jobs.local
                )

            self.spin(quiet)
            assert dispatcher.workload.admitting == 0
            assert self.instance.cache.reserved_bytes() == 0
            assert len(RUNS.started) == len(set(RUNS.started))
            assert RUNS.peak <= 1
            for job_id in self.jobs:
                job = self.run(self.instance.job(job_id, key_id=None))
                assert job.status.final, job
            self.run(self.instance.stop())
        finally:
            self.loop.close()
            shutil.rmtree(self.root, ignore_errors=True)


CapacityMachine.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_capacity_machine = CapacityMachine.TestCase
