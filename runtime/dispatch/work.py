"""One piece of work, from admission to settlement, and the workload that counts it.

Every invocation (a request, a job recovered from the store) is one `Work`.
Whichever scheduler starts it (the dispatcher alone, a batch, the decode steps)
and wherever the executor runs it (a handler thread, the loop), its life is told
through the work's own methods:

    admitted      Work(...)       its outcome future; a queue slot, taken by the
                                  dispatcher before the first await
    queued        queued()        queue (and load) times recorded
    started       started()       its handler's call began: phase, its wait for a
                                  batch or a decode slot (its run is watched for
                                  THAW_RUN_TIMEOUT_S by the executor it is handed
                                  to: executor.py)
    ran           ran()           run time: Server-Timing, estimator, stats
    ended         ended_with()    the executor's outcome of its own call, or
                  succeed() / fail() / cancel() (a batch's or a decode lane's
                  share of theirs), or overrun() (the executor found its run past
                  the limit), or its outcome cancelled from outside (a drain, a
                  job's lost lease, a streaming client gone)
    settled       settle()        the one end of every piece of work

`settle` is the only place that lets go of the work's models, wakes its
waiting request, takes it out of flight, has the executor forget its run,
gives back its queue slot and counts an error. It runs at once where the work
ends on the loop (so the waiting request resumes one turn after the work
ends, not two), and as the outcome's done callback for an end that comes from
outside; whichever comes first settles, the other finds it settled.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from typing import Any

from runtime.clock import Clock
from runtime.context import Context
from runtime.dispatch.executor import Executor, Gate, Outcome, ThreadOutcome, user_error
from runtime.dispatch.streams import Stream
from runtime.errors import Draining, HandlerTimeout, ThawError
from runtime.models.cache import Lease
from runtime.models.estimate import Estimator
from runtime.registry import HandlerSpec
from runtime.telemetry.health import Health
from runtime.telemetry.metrics import HandlerStats, Metrics


class Workload:
    """The work of one dispatcher in progress: queue slots taken, outcomes in flight,
    requests on their way to their start; and what each piece of work reports
    its times to (clock, estimator, metrics, health) and is run by (the executor,
    which watches its run)."""

    def __init__(
        self,
        *,
        clock: Clock,
        estimator: Estimator,
        metrics: Metrics,
        health: Health,
        executor: Executor,
    ) -> None:
        self.clock = clock
        self.executor = executor
        self.now = clock.monotonic
        self.estimator = estimator
        self.metrics = metrics
        self.health = health
        # Queue slots taken, by handler (admitted and not settled).
        self.pending: dict[str, int] = defaultdict(int)
        # Outcomes of the work in flight (started and not settled).
        self.in_flight: set[asyncio.Future[Any]] = set()
        # Requests between taking their queue slot and starting their work (awaits in
        # between: a cold estimate, a job record), which a drain waits for as for
        # work in flight; `admitted` is set, and woken by the last one to start, while
        # someone waits for that.
        self.admitting = 0
        self.admitted: asyncio.Future[None] | None = None

    async def quiet_by(self, until: float | None) -> bool:
        """Wait until no request is on its way to its start and no work is in flight,
        or until `until` on the clock at the latest (None: however long); True when quiet."""
        loop = asyncio.get_running_loop()
        while self.admitting or self.in_flight:
            if until is not None and self.now() >= until:
                return False
            waiter: asyncio.Future[None] = loop.create_future()
            wake_it = partial(wake, waiter)
            if self.admitting:
                self.admitted = waiter
            watched = list(self.in_flight)
            for outcome in watched:
                outcome.add_done_callback(wake_it)
            try:
                if until is None:
                    await waiter
                else:
                    await self.clock.wait_until(waiter, until)
            finally:
                if self.admitted is waiter:
                    self.admitted = None
                for outcome in watched:
                    outcome.remove_done_callback(wake_it)
        return True


def wake(waiter: asyncio.Future[None], _: object = None) -> None:
    """Set `waiter` unless it is done (also as a done callback)."""
    if not waiter.done():
        waiter.set_result(None)


def result_of(outcome: asyncio.Future[Any]) -> Any:
    """The work's output for its waiting caller; work cut off by a drain is `drained`."""
    if outcome.cancelled():
        raise Draining("the instance drained before this request finished; send it again")
    return outcome.result()


def release(leases: list[Lease]) -> None:
    for lease in leases:
        lease.release()


class Work:
    """One invocation's work: its outcome, what it holds, and what it has been doing
    (for Server-Timing and the job's phase).

    A plain slotted class: one is made per request, and a dataclass with a
    default factory costs several times as much to build.
    """

    __slots__ = (
        "_phase",
        "batch_size",
        "call",
        "claim",
        "ctx",
        "handler",
        "leases",
        "on_phase",
        "outcome",
        "run_started",
        "running",
        "settled",
        "spec",
        "stats",
        "stream",
        "task",
        "timings_ms",
        "waiter",
        "workload",
    )

    def __init__(
        self,
        workload: Workload,
        spec: HandlerSpec,
        ctx: Context,
        stats: HandlerStats,
        phase: str = "queued",
        stream: Stream | None = None,
    ) -> None:
        """`spec` as it runs (a generator handler's bound to its `stream`)."""
        self.workload = workload
        self.spec = spec
        self.handler = spec.name
        self.ctx = ctx
        self.stats = stats
        self._phase = phase
        # Set for work a job records (runtime/dispatch/dispatcher.py): told of each
        # change of phase, so that the job shows it now, not at its next heartbeat.
        self.on_phase: Callable[[], object] | None = None
        # In phase order (queue, fetch, load, init, warmup, batch, run), as
        # Server-Timing lists them.
        self.timings_ms: dict[str, float] = {}
        self.running = False
        self.run_started = 0.0
        # The models it holds, let go of when it settles.
        self.leases: list[Lease] = []
        # Its outcome: what its request waits for, its job records, its stream ends with.
        self.outcome: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        # Made by a request that waits for the work; set when the work settles.
        self.waiter: asyncio.Future[None] | None = None
        # What drives it where it had to wait on the loop (a load's task, an async
        # handler's call that suspended); cancelled if the work ends before it does.
        self.task: asyncio.Future[Any] | None = None
        # Settled: nothing left to let go of or count (see `settle`).
        self.settled = False
        # Requests in the batch it ran in (runtime/dispatch/batcher.py); None: unbatched.
        self.batch_size: int | None = None
        # A generator handler's items (runtime/dispatch/streams.py).
        self.stream = stream
        # A sync call's future on the handler threads (Executor.submit): gated by its
        # job's claim if its caller's deadline comes while it still waits for a thread.
        self.call: ThreadOutcome | None = None
        # A job recorded queued (its instance could not start it at once) is claimed
        # by id just before its handler runs: the claim, True when this instance won.
        self.claim: Gate | None = None

    @property
    def phase(self) -> str:
        """What it is doing: queued, loading, batching, running (a job's `phase`)."""
        return self._phase

    @phase.setter
    def phase(self, phase: str) -> None:
        if phase != self._phase:
            self._phase = phase
            if self.on_phase is not None:
                self.on_phase()

    # ---- on its way ---------------------------------------------------------------

    def queued(self, since: float, load_ms: dict[str, float]) -> float:
        """Record its queue and load times since `since`, up to now (returned)."""
        now = self.workload.now()
        timings = self.timings_ms
        queue_ms = max(0.0, (now - since) * 1000 - sum(load_ms.values()))
        timings["queue"] = queue_ms
        if load_ms:
            timings.update(load_ms)
        self.stats.observe_queue(queue_ms / 1000)
        return now

    def started(
        self,
        at: float,
        waited_since: float | None = None,
        batch_size: int | None = None,
        leader: bool = True,
    ) -> None:
        """Its handler's call began at `at`: it runs from there (the scheduler hands the
        call to the executor, which watches the run).

        `waited_since`: it waited for a place in a call (a batch's, a decode
        slot) from then, shown as Server-Timing's `batch`. `batch_size`: the
        batch it runs in, whose `leader` (its first member) records what is the
        batch's own."""
        if batch_size is not None:
            batches = self.workload.metrics.batch(self.handler)
            if leader:
                batches.observe_size(batch_size)
            assert waited_since is not None
            batches.observe_wait(max(0.0, at - waited_since))
            self.batch_size = batch_size
        if waited_since is not None:
            self.timings_ms["batch"] = max(0.0, at - waited_since) * 1000
        if self.on_phase is None:  # no job to tell: the setter's call spared
            self._phase = "running"
        else:
            self.phase = "running"
        self.running = True
        self.run_started = at

    def waits(self) -> None:
        """Its sync call still waits for a handler thread after all (gated at its
        caller's deadline, claims.py): queued until it is `started` again as a
        thread takes it (the executor times the call from then too)."""
        self._phase = "queued"
        self.running = False

    def ran(self, run_s: float | None = None, leader: bool = True) -> None:
        """Its call returned (after `run_s`; None: since it started), for Server-Timing,
        the estimate and the stats: one run per call for the estimate (what a
        request waits for: a batch's recorded by its `leader`), one per member in
        the stats."""
        workload = self.workload
        if run_s is None:
            run_s = workload.now() - self.run_started
        self.timings_ms["run"] = run_s * 1000
        if leader:
            workload.estimator.record_run(self.handler, run_s)
        self.stats.observe_run(run_s)

    # ---- ending -------------------------------------------------------------------

    def succeed(self, output: Any) -> None:
        if not self.outcome.done():
            self.outcome.set_result(output)
        self.settle()

    def fail(self, error: BaseException) -> None:
        """It failed with `error`, Thaw's error already (see `executor.user_error`)."""
        if not self.outcome.done():
            self.outcome.set_exception(error)
        self.settle()

    def cancel(self) -> None:
        """It never ran, or nobody waits for it any more."""
        self.outcome.cancel()
        self.settle()

    def ended_with(self, done: Outcome) -> None:
        """Its own call ended (the executor's outcome, on the loop): the work ends with it."""
        if self.outcome.done():  # cut off (a drain, a job's lost lease, its run limit)
            return
        if done.cancelled():  # never ran (the handler threads were shut down), or stopped
            self.cancel()
        elif (exc := done.exception()) is not None:
            self.fail(user_error(self.spec, self.ctx, exc))
        else:
            self.ran()
            self.succeed(done.result())

    def overrun(self) -> None:
        """Its handler ran past THAW_RUN_TIMEOUT_S (the executor's watch says so: a work
        is what it watches, `Watched`): it fails with `handler-timeout`."""
        if self.outcome.done():
            return
        workload = self.workload
        limit_s = workload.executor.run_limit_s
        if not self.spec.is_async and self.spec.decode is None:
            # Its thread cannot be stopped, and keeps the model and memory it holds (a
            # sequence of the decode steps is dropped at the next step instead).
            workload.health.wedge(
                f"handler {self.handler!r} ran past THAW_RUN_TIMEOUT_S={limit_s:g}"
            )
        self.fail(
            HandlerTimeout(
                f"handler {self.handler!r} did not finish within {limit_s:g} s "
                "(THAW_RUN_TIMEOUT_S)",
                handler=self.handler,
            )
        )

    def settle(self, _outcome: object = None) -> None:
        """The one end of every piece of work, once its outcome is set (also its done
        callback): its models let go of, its waiting request woken, out of flight,
        its run forgotten by the executor, its queue slot given back, an error
        counted. A task still driving it is cancelled (an async handler stops at
        its next await); a handler thread cannot be, and keeps its own reference
        to the model."""
        if self.settled:
            return
        self.settled = True
        # Its thread's future holds its callback, which holds this work: let go of it,
        # so the work is freed by its count, not left to the cycle collector.
        self.call = None
        if self.leases:
            leases, self.leases = self.leases, []
            for lease in leases:
                lease.release()
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        workload = self.workload
        outcome = self.outcome
        workload.in_flight.discard(outcome)
        workload.executor.forget(self)
        workload.pending[self.handler] -= 1
        task = self.task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
        if not outcome.cancelled() and (exc := outcome.exception()) is not None:
            # A request the handler refused (it raised a 4xx error, e.g. invalid-input)
            # is the caller's fault, not the handler's.
            client = isinstance(exc, ThawError) and exc.status < 500
            self.stats.count("client_error" if client else "error")
