"""The whole life of `Work`, as a property: whatever happens to it, in any order.

A Hypothesis state machine over real `Work`s kept in real `Workload`
(runtime/dispatch/work.py), run by a real `Executor` whose run-limit watch is
on the manual clock. Its rules are what the schedulers and the executor do to
a piece of work (admit it, start it alone, in a batch or as a decode step and
hand it to the executor's watch, end its call with an output, an error or a
cancellation) and what comes from outside (a cancel, a drain's cut-off, its
run limit passing as the clock moves). After every step:

- a settled work's outcome is set, and each work settles exactly once: its
  queue slot is given back once (the workload count the unsettled ones), it is
  out of flight, the executor no longer watches its run, its waiting request
  is woken;
- each model lease is released exactly once, and only once its work settled;
- only running, unsettled work is watched for its run limit.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from runtime.clock import ManualClock
from runtime.context import Context
from runtime.dispatch.executor import Executor
from runtime.dispatch.work import Work, Workload
from runtime.errors import HandlerError
from runtime.models.estimate import Estimator
from runtime.registry import discover
from runtime.telemetry.health import Health
from runtime.telemetry.metrics import Metrics

RUN_LIMIT_S = 10.0


class CountedLease:
    """A model lease that counts its releases (the cache's own ignores a second), and
    whether its work had settled, its outcome set, when it was released."""

    def __init__(self) -> None:
        self.model = object()
        self.releases = 0
        self.early = False
        self.work: Work | None = None

    def release(self) -> None:
        self.releases += 1
        work = self.work
        if work is None or not (work.settled and work.outcome.done()):
            self.early = True


class Tracked:
    """One work and the leases it was given."""

    def __init__(self, work: Work, leases: list[CountedLease]) -> None:
        self.work = work
        self.leases = leases


class WorkMachine(RuleBasedStateMachine):
    works = Bundle("works")

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = ManualClock()
        self.metrics = Metrics()
        self.health = Health(self.clock)
        # Its threads are never started: the rules hand the executor's watch what a
        # scheduler would, and end each call themselves.
        self.executor = Executor(1, run_limit_s=RUN_LIMIT_S, clock=self.clock)
        # The estimator's state directory, removed in teardown: one per example.
        self.state = tempfile.TemporaryDirectory(prefix="thaw-work-")
        estimator = Estimator(
            Path(self.state.name),
            default_bandwidth_bytes_s=1e9,
            default_init_s=0.1,
        )
        self.workload = Workload(
            clock=self.clock,
            estimator=estimator,
            metrics=self.metrics,
            health=self.health,
            executor=self.executor,
        )
        registry = discover(["tests.handlers.echo"])
        self.spec = next(iter(registry.handlers.values()))
        self.all: list[Tracked] = []
        self.count = 0

    def spin(self) -> None:
        async def turns() -> None:
            for _ in range(3):
                await asyncio.sleep(0)

        self.loop.run_until_complete(turns())

    def teardown(self) -> None:
        for tracked in self.all:
            tracked.work.cancel()
        self.spin()
        self.check_books()
        self.executor.shutdown()
        self.loop.close()
        self.state.cleanup()

    # ---- what the dispatcher, the schedulers and the executor do -------------------

    @rule(target=works, models=st.integers(0, 2), waits=st.booleans())
    def admit(self, models: int, waits: bool) -> Tracked:
        async def make() -> Tracked:
            self.count += 1
            name = self.spec.name
            ctx = Context(request_id=f"w{self.count}", handler=name, clock=self.clock)
            self.workload.pending[name] += 1
            work = Work(self.workload, self.spec, ctx, self.metrics.handler(name))
            leases = [CountedLease() for _ in range(models)]
            for lease in leases:
                lease.work = work
            work.leases = list(leases)  # type: ignore[arg-type]
            if waits:
                work.waiter = asyncio.get_running_loop().create_future()
            self.workload.in_flight.add(work.outcome)
            work.outcome.add_done_callback(work.settle)
            return Tracked(work, leases)

        tracked = self.loop.run_until_complete(make())
        self.all.append(tracked)
        return tracked

    @rule(tracked=works)
    def start_alone(self, tracked: Tracked) -> None:
        work = tracked.work
        if not work.running and not work.settled:
            at = work.queued(self.clock.monotonic(), {})
            work.started(at)
            self.executor.watch([work], at)

    @rule(members=st.lists(works, min_size=1, max_size=4, unique_by=id))
    def start_batch(self, members: list[Tracked]) -> None:
        ready = [t.work for t in members if not t.work.running and not t.work.settled]
        now = self.clock.monotonic()
        for index, work in enumerate(ready):
            work.started(now, now - 0.01, len(ready), leader=index == 0)
        self.executor.watch(ready, now)  # one call for the batch, its members watched

    @rule(tracked=works)
    def decode_step_admits(self, tracked: Tracked) -> None:
        work = tracked.work
        if not work.running and not work.settled:
            at = self.clock.monotonic()
            work.started(at, work.queued(at, {}))
            self.executor.watch([work], at)  # from its prefill to its end

    @rule(tracked=works, output=st.integers())
    def call_returns(self, tracked: Tracked, output: int) -> None:
        done: asyncio.Future[Any] = self.loop.create_future()
        done.set_result(output)
        if tracked.work.running:
            tracked.work.ended_with(done)

    @rule(tracked=works)
    def call_raises(self, tracked: Tracked) -> None:
        done: asyncio.Future[Any] = self.loop.create_future()
        done.set_exception(ValueError("user code failed"))
        tracked.work.ended_with(done)
        done.exception()  # read, where the work was over already

    @rule(tracked=works)
    def call_cancelled(self, tracked: Tracked) -> None:
        done: asyncio.Future[Any] = self.loop.create_future()
        done.cancel()
        tracked.work.ended_with(done)

    @rule(tracked=works)
    def batch_shares_a_failure(self, tracked: Tracked) -> None:
        tracked.work.fail(HandlerError("the batch failed", handler=self.spec.name))

    # ---- what comes from outside ---------------------------------------------------

    @rule(tracked=works)
    def cancelled(self, tracked: Tracked) -> None:
        tracked.work.cancel()

    @rule(tracked=works)
    def cut_off_from_outside(self, tracked: Tracked) -> None:
        """A streaming client gone, a job's lost lease: its outcome is cancelled."""
        tracked.work.outcome.cancel()
        self.spin()

    @rule()
    def drain_cuts_off_everything(self) -> None:
        for outcome in list(self.workload.in_flight):
            outcome.cancel()
        self.spin()

    @rule(seconds=st.sampled_from([0.5, 5.0, RUN_LIMIT_S, 2 * RUN_LIMIT_S]))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.spin()

    # ---- what holds after every step ---------------------------------------------------

    @invariant()
    def books_agree(self) -> None:
        self.spin()
        self.check_books()

    def check_books(self) -> None:
        unsettled = [t.work for t in self.all if not t.work.settled]
        assert self.workload.pending[self.spec.name] == len(unsettled)
        assert self.workload.in_flight == {work.outcome for work in unsettled}
        watched = len(self.executor.overruns)
        assert watched <= sum(1 for work in unsettled if work.running)
        for tracked in self.all:
            work = tracked.work
            if work.settled:
                assert work.outcome.done()
                assert work.waiter is None or work.waiter.done()
                assert not work.leases
                assert all(lease.releases == 1 for lease in tracked.leases), tracked.leases
            else:
                assert all(lease.releases == 0 for lease in tracked.leases)
            assert not any(lease.early for lease in tracked.leases)


WorkMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_work_machine = WorkMachine.TestCase
