"""The deadline rule: answer every invocation before its deadline.

    READY            -> run
    not READY        -> estimate remaining load + run time
        fits         -> wait for the (single-flight) load, then run
        does not fit -> create a job, answer 202 at once
    estimate wrong   -> just before the deadline, turn the waiting request into
                        a job and answer 202; the work goes on
    (a caller whose policy says `retry` gets a 503 to retry after instead of a
    job: warming.py; the policies: answers.py)

In a fleet, a job this instance cannot start soon is recorded queued, for an
idle warm instance, and claimed by id as it starts here (claims.py). The work
of every invocation is started once, at admission, and a request
that becomes a job keeps that same work, so nothing runs twice. Every kind of
work takes one path (`_start`, then `_run` once its models are leased): a
batched one to its queue (batcher.py), a step-level one to the decode steps
(decode.py), any other to the executor at once (executor.py: a sync handler
on a handler thread, an async one on the loop); the executor runs all user
code, the dispatcher and the schedulers only decide when. It
costs a task only where it must wait on the loop: work that needs a load, or
an async handler that suspends (eager.py). Each piece of work is a `Work`
(runtime/dispatch/work.py), which records its own progress and ends through
its one settlement, however it ran.

A generator handler's work runs bound to a `Stream` (streams.py). A stream
begins once its work holds its models, whatever it then waits for (a thread, a
batch, a decode slot): only a load past the deadline makes a 202 job.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any

from runtime.clock import Clock
from runtime.context import CLIENT_CONTEXT, Context
from runtime.dispatch import claims, eager
from runtime.dispatch.answers import WAIT, Accepted, Answer, Completed, Policy, Streaming
from runtime.dispatch.batcher import Batcher
from runtime.dispatch.deadlines import Deadlines
from runtime.dispatch.decode import Decoder
from runtime.dispatch.executor import Executor
from runtime.dispatch.recorded import Recorder
from runtime.dispatch.streams import Stream, Streams
from runtime.dispatch.warming import Warming
from runtime.dispatch.work import Work, Workload, release, result_of, wake
from runtime.errors import Draining, QueueFull
from runtime.jobs.job import Job
from runtime.jobs.manager import JobManager, JobRunner
from runtime.models.cache import Lease, ModelCache
from runtime.models.estimate import Estimator
from runtime.models.lifecycle import LOAD_PHASES
from runtime.registry import HandlerSpec, Registry
from runtime.settings import Settings
from runtime.telemetry.health import Health
from runtime.telemetry.logs import REQUEST_ID
from runtime.telemetry.metrics import HandlerStats, Metrics

log = logging.getLogger("thaw.dispatch")
# Looked up once: `logging.getLogger` takes the logging module's lock on every call.
HANDLER_LOG = logging.getLogger("thaw.handler")

# The first `import torch` of a process holds the GIL for a few hundred ms (torch._C's
# module init), freezing the event loop and every deadline timer with it. While that
# import is still ahead, waiting requests keep this much more in hand.
FRAMEWORK_STALL_S = 0.4
# After a drain's grace, how long cut-off work gets to reach its next step and end.
ABORT_WAIT_S = 5.0


class Dispatcher:
    def __init__(
        self,
        *,
        settings: Settings,
        registry: Registry,
        cache: ModelCache,
        jobs: Callable[[JobRunner], JobManager],
        estimator: Estimator,
        metrics: Metrics,
        executor: Executor,
        health: Health,
        clock: Clock,
    ) -> None:
        """`jobs` builds the job manager with this dispatcher as the runner of the
        jobs it recovers: the two need each other, and neither is patched after.
        `clock` is the instance's: deadlines are on its `monotonic()`, and every
        timer here (deadlines, batches) is armed through it, as the executor's
        run limits are."""
        self.settings = settings
        self.health = health
        self.registry = registry
        self.cache = cache
        self.jobs = jobs(self)
        self.estimator = estimator
        self.metrics = metrics
        self.executor = executor
        self.clock = clock
        self._now = clock.monotonic
        self.draining = False
        self.workload = Workload(
            clock=clock,
            estimator=estimator,
            metrics=metrics,
            health=health,
            executor=executor,
        )
        # Queue slots by handler, and the outcomes of the work in flight (the workload's).
        self.pending = self.workload.pending
        self.in_flight = self.workload.in_flight
        self.deadlines = Deadlines(clock)
        self.batcher = Batcher(
            executor=executor,
            run_estimate_s=estimator.run_s,
            margin_s=settings.deadline_margin_s,
            clock=clock,
        )
        self.decoder = Decoder(executor=executor, clock=clock)
        self.streams = Streams()
        self.recorder = Recorder(
            self.jobs, self.streams, cache, executor, self.handler_stats, self._busy
        )
        self.warming = Warming(cache)
        for name in registry.handlers:
            self.handler_stats(name)

    def _busy(self, spec: HandlerSpec) -> bool:
        """Whether `spec` is at its declared concurrency: work joining now would wait."""
        if spec.batch is not None:
            return self.batcher.busy(spec.name)
        return spec.decode is not None and self.decoder.busy(spec.name)

    def handler_stats(self, name: str) -> HandlerStats:
        found = self.metrics.handlers.get(name)
        if found is None:
            found = self.metrics.handler(name)
            # Read at scrape time, so the warm path does not take the gauge's lock twice.
            self.metrics.queue_depth.labels(name).set_function(lambda: self.pending[name])
            if (spec := self.registry.handlers.get(name)) and spec.decode is not None:
                self.decoder.export(name, self.metrics)
        return found

    # ---- the deadline rule ------------------------------------------------------

    async def invoke(
        self,
        name: str,
        event: Any,
        *,
        wait_s: float | None = None,
        policy: Policy = WAIT,
        request_id: str,
        key_id: str | None = None,
    ) -> Answer:
        """`name` run on `event` under the deadline rule, answered as `policy` says
        (answers.py): its output, its stream, its job, or (`retry`) WarmingUp."""
        received = self._now()
        stream = policy.stream
        jobless = policy.late == "retry"
        spec = self.registry.handlers.get(name) or self.registry.handler(name)  # that says why
        if self.draining:
            raise Draining("this instance is draining and takes no new work")
        stats = self.metrics.handlers.get(name) or self.handler_stats(name)
        if self.pending[name] >= self.settings.max_queue:
            stats.count("throttled")
            raise QueueFull(
                f"handler {name!r} has {self.pending[name]} requests queued "
                f"(limit {self.settings.max_queue})",
                retry_after_s=max(1.0, await self._estimate_s(spec)),
            )
        # The slot is taken before the first await, so that concurrent requests
        # see it: the limit holds however many arrive at once. `_start` keeps it
        # for the work (its settlement gives it back); anything failing before
        # that gives it back here.
        self.pending[name] += 1
        workload = self.workload
        workload.admitting += 1
        started = False
        try:
            wait = self.settings.wait_s if wait_s is None else wait_s
            deadline_at = received + wait
            ctx = Context(
                request_id=request_id,
                handler=name,
                deadline_at=deadline_at,
                logger=HANDLER_LOG,
                client_context=CLIENT_CONTEXT.get(),
                correlation_id=REQUEST_ID.get(),
                clock=self.clock,
            )
            cold = bool(spec.uses) and not all(map(self.cache.is_ready, spec.uses))
            items = Stream(spec) if stream or spec.stream_fn is not None else None
            run_spec = spec if items is None else items.bind(spec)
            work = Work(self.workload, run_spec, ctx, stats, "loading" if cold else "queued", items)
            if stream:
                # A stream waits for its models only: it answers once the handler begins.
                estimate_s = await self._ready_s(spec) if cold else 0.0
            else:
                # Warm: nothing to load, so the estimate is the run time (no cache lookups).
                estimate_s = await self._estimate_s(spec) if cold else self.estimator.run_s(name)
            # The margin never eats more than a quarter of a short deadline, so a
            # warm request with `wait=0.1` still runs instead of becoming a job.
            answer_by = deadline_at - min(self.settings.deadline_margin_s, wait * 0.25)
            if spec.uses and self.cache.device is None:
                answer_by -= FRAMEWORK_STALL_S
            if policy.late == "job-now" or estimate_s > answer_by - self._now():
                if jobless:  # no job: a 503 to retry after (warming.py)
                    raise self.warming.refuse(spec, estimate_s, wait)

                def start(work: Work, event: Any) -> None:
                    nonlocal started
                    self._start(work, event)
                    started = True

                # Recorded, then started (recorded.py): `start` takes the queue slot over.
                job = await self.recorder.submit(spec, event, work, key_id, start)
                return Accepted(job, retry_after_s=max(1.0, estimate_s))
            outcome = self._start(work, event)
            started = True
        finally:
            if not started:
                self.pending[name] -= 1
            workload.admitting -= 1
            if not workload.admitting and workload.admitted is not None:
                workload.admitted.set_result(None)
                workload.admitted = None
        if stream:
            assert items is not None
            if await self._started_by(items, answer_by):
                stats.count("sync")
                return Streaming(items, work.timings_ms)
        elif outcome.done() or await self._settled_by(work, answer_by):
            output = result_of(outcome)
            stats.outcomes["sync"] += 1  # stats.count, inline: every warm answer
            return Completed(output, work.timings_ms, work.batch_size)
        # The estimate was wrong: answer 202 now; the same work goes on.
        if jobless:
            work.cancel()
            raise self.warming.refuse(spec, await self._estimate_s(spec), wait)
        # Still waiting for its models (its handler not reached: no leases yet), for a
        # run slot of its batch or for a handler thread (its call gated now: the claim
        # set below is made as a thread takes it): the fleet's, claimed before it runs
        # (claims.py).
        shared = self.jobs.shared_queue
        if gated := shared and work.call is not None:
            gated = self.executor.gate_waiting(work.call, partial(claims.claimed, work))
            if gated:
                work.waits()
        queued = gated or (
            shared and ((bool(spec.uses) and not work.leases) or self.batcher.holds(work))
        )
        job = await self.recorder.turn_into_job(spec, event, work, key_id, queued)
        return Accepted(job, retry_after_s=max(1.0, await self._estimate_s(spec)))

    async def _settled_by(self, work: Work, answer_by: float) -> bool:
        """Wait until `answer_by` at the latest for the work to settle; True when it is done.
        The work's settlement sets `work.waiter` itself, so the waiting request resumes
        in the next turn of the loop, not two turns later (outcome -> callbacks -> ...)."""
        work.waiter = asyncio.get_running_loop().create_future()
        await self.deadlines.wait(work.waiter, answer_by)
        return work.outcome.done()

    async def _started_by(self, stream: Stream, answer_by: float) -> bool:
        """Wait until `answer_by` at the latest for the handler to begin; True when it has."""
        waiter = asyncio.get_running_loop().create_future()
        stream.started.add_done_callback(partial(wake, waiter))
        await self.deadlines.wait(waiter, answer_by)
        return stream.started.done()

    async def _ready_s(self, spec: HandlerSpec) -> float:
        return max([await self.cache.estimate_ready_s(name) for name in spec.uses], default=0.0)

    async def _estimate_s(self, spec: HandlerSpec) -> float:
        return await self._ready_s(spec) + self.estimator.run_s(spec.name)

    # ---- the one path of every piece of work ----------------------------------------

    def _start(self, work: Work, event: Any) -> asyncio.Future[Any]:
        """Start the work now (its queue slot taken already): the future of its outcome.

        Work whose models are ready leases them at once (`leases_now`: all or
        none) and runs; work that must wait for a load is a coroutine started
        eagerly, which runs the same way once it holds its leases.
        """
        spec = work.spec
        outcome = work.outcome
        leases = self.cache.leases_now(spec.uses) if spec.uses else []
        if leases is None:
            work.task = eager.drive(self._load_then_run(work, event))
        else:
            work.leases = leases
            models = [lease.model for lease in leases] if leases else []  # no frame for none
            run = self._run(work, event, models, self._now(), {})
            if run is not None:
                work.task = eager.drive(run)
        if work.stream is not None:
            work.stream.attach(outcome)
        if not work.settled:
            self.in_flight.add(outcome)
            # An end from outside (a drain, a job's lost lease, a streaming client
            # gone) cancels the outcome: the work settles then.
            outcome.add_done_callback(work.settle)
        return outcome

    def _run(
        self, work: Work, event: Any, models: list[Any], started: float, load_ms: dict[str, float]
    ) -> Coroutine[Any, Any, None] | None:
        """Schedule the work, its models leased (queued since `started`, `load_ms`
        loading): a batched handler joins its batch queue, a step-level one its
        decode lane, and any other is handed to the executor now (its outcome
        settles the work). A coroutine is returned, for the caller to drive, only
        where a queued job's claim must be won first (claims.py)."""
        spec = work.spec
        # A batched member is claimed as its batch is about to run (batcher.py), a
        # sequence as its prefill takes a slot (decode.py), a sync call on its thread.
        if work.claim is not None and spec.is_async and spec.batch is None:
            run = partial(self._run, work, event, models, started, load_ms)
            return claims.claimed_then(work, run)
        if work.stream is not None:  # models leased: a READY stream answers now, never a job
            work.stream.begin()
        if spec.decode is not None:
            work.queued(started, load_ms)
            self.decoder.join(work, event, models)
            return None
        if spec.batch is not None:
            work.queued(started, load_ms)
            work.phase = "batching"
            self.batcher.join(work, event, models)
            return None
        at = work.queued(started, load_ms)
        work.started(at)
        gate, work.claim = work.claim, None  # a queued job's claim, on its thread (claims.py)
        call = partial(spec.fn, event, *models, work.ctx)
        if not spec.is_async:
            work.call = self.executor.submit(spec, call, work.ended_with, gate, (work,), at)
            return None
        running = self.executor.run(spec, call, work.ended_with, gate, (work,), at)
        if running is not None and not running.done():
            work.task = running  # an async call that waits: stopped if the work is cut off
        return None

    async def _load_then_run(self, work: Work, event: Any) -> None:
        """Work that must wait for its models: load (single flight) and lease them, then run."""
        spec = work.spec
        started = self._now()
        load_ms: dict[str, float] = {}
        leases: list[Lease] = []
        try:
            work.phase = "loading"
            cold = [n for n in spec.uses if not self.cache.is_ready(n)]
            if len(spec.uses) == 1:
                # One bundle needs no gather (which wraps each awaitable in a task).
                leases.append(await self.cache.acquire(spec.uses[0]))
            else:
                results = await asyncio.gather(
                    *(self.cache.acquire(n) for n in spec.uses), return_exceptions=True
                )
                leases = [r for r in results if isinstance(r, Lease)]
                for r in results:
                    if isinstance(r, BaseException):
                        raise r
            for name in cold:
                phases = self.cache.entries[name].lifecycle.phase_ms
                for phase in LOAD_PHASES:
                    load_ms[phase] = load_ms.get(phase, 0.0) + phases.get(phase, 0.0)
        except asyncio.CancelledError:
            release(leases)
            work.cancel()
            raise
        except Exception as exc:  # the runtime's own (load-failed, ...): as they are
            release(leases)
            work.fail(exc)
            return
        if work.outcome.done():  # cut off while it waited: nobody runs it
            release(leases)
            return
        work.leases = leases
        run = self._run(work, event, [lease.model for lease in leases], started, load_ms)
        if run is not None:
            await run

    def can_run(self, handler: str) -> bool:
        """Whether a stored job of `handler` can run here (the JobRunner protocol)."""
        return handler in self.registry.handlers

    def run_job(self, job: Job) -> asyncio.Future[Any]:
        """Run a recovered (or queued) job's stored input here (the JobRunner protocol);
        a generator handler's items are kept for followers (`items_of`)."""
        spec = self.registry.handler(job.handler)
        ctx = Context(request_id=job.id, handler=job.handler, logger=HANDLER_LOG, clock=self.clock)
        self.pending[spec.name] += 1
        items = Stream(spec) if spec.streams else None
        run_spec = spec if items is None else items.bind(spec)
        work = Work(self.workload, run_spec, ctx, self.handler_stats(spec.name), stream=items)
        outcome = self._start(work, job.input)
        if items is not None:
            self.streams.hold(job.id, items)
        return outcome

    def items_of(self, job_id: str) -> Stream | None:
        """The items of a job's run here, as they come (the JobRunner protocol)."""
        return self.streams.get(job_id)

    # ---- drain ------------------------------------------------------------------

    async def wait_idle(self) -> None:
        """Returns once no invocation or job of this instance is admitted or running."""
        await self.workload.quiet_by(None)
        await self.jobs.wait_idle()

    def abort_in_flight(self) -> None:
        """Cut off every piece of work still running now: waiting callers get 503
        `drained`, jobs a retryable `drained` error (the end of a drain's grace)."""
        for outcome in list(self.in_flight):
            outcome.cancel()

    async def drain(self, grace_s: float) -> None:
        """Refuse new work, let admitted and in-flight work finish for `grace_s`, abort the rest."""
        self.draining = True
        await self.workload.quiet_by(self._now() + grace_s)
        await self.jobs.abort_all()
        self.abort_in_flight()
        # What was cut off ends at its next step; a request still on its way to its
        # start (a store write past the grace) starts, and is cut off in turn.
        await self.workload.quiet_by(self._now() + ABORT_WAIT_S)
        self.abort_in_flight()
        await self.cache.unload_all()
