"""The deadline rule: answer every invocation before its deadline.

    READY            -> run
    not READY        -> estimate remaining load + run time
        fits         -> wait for the (single-flight) load, then run
        does not fit -> create a job, answer 202 at once
    estimate wrong   -> just before the deadline, turn the waiting request into
                        a job and answer 202; the work goes on

The work of every invocation is started once, at admission, and a request
that becomes a job keeps that same work, so nothing runs twice. It costs a
task only where it must wait on the loop: work that needs a load, or an async
handler that suspends (runtime/dispatch/eager.py). A sync handler whose models are
ready goes straight to a handler thread, and the thread's callback finishes
it (runtime/dispatch/calls.py).

A generator handler's work runs bound to a `Stream` (runtime/dispatch/streams.py).
For a caller that asked for the stream the rule waits for the handler to
begin, not to end: READY models start the stream at once, and only a load
that would pass the deadline makes the usual 202 job.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from runtime.context import CLIENT_CONTEXT, Context
from runtime.dispatch import eager
from runtime.dispatch.batcher import Batcher, Member
from runtime.dispatch.calls import Caller, ThreadOutcome, caller_error, handler_error
from runtime.dispatch.deadlines import Deadlines
from runtime.dispatch.overruns import Overruns
from runtime.dispatch.streams import Stream, Streaming, Streams
from runtime.errors import Draining, HandlerTimeout, QueueFull, ThawError
from runtime.jobs.job import Job
from runtime.jobs.manager import JobManager, JobRunner
from runtime.models.cache import Lease, ModelCache
from runtime.models.estimate import Estimator
from runtime.models.lifecycle import LOAD_PHASES
from runtime.registry import HandlerSpec, Registry
from runtime.settings import Settings
from runtime.telemetry.health import Health
from runtime.telemetry.metrics import HandlerStats, Metrics

log = logging.getLogger("thaw.dispatch")
# Looked up once: `logging.getLogger` takes the logging module's lock on every call.
HANDLER_LOG = logging.getLogger("thaw.handler")

# The first `import torch` of a process holds the GIL for a few hundred ms
# (torch._C's module init), freezing the event loop and every deadline timer
# with it. While that import is still ahead, waiting requests keep this much
# more in hand.
FRAMEWORK_STALL_S = 0.4


@dataclass
class Completed:
    output: Any
    timings_ms: dict[str, float]
    # How many requests shared its handler call (None: the handler does not batch).
    batch_size: int | None = None


@dataclass
class Accepted:
    job: Job
    retry_after_s: float


def _result(outcome: asyncio.Future[Any]) -> Any:
    """The work's output for its waiting caller; work cut off by a drain is `drained`."""
    if outcome.cancelled():
        raise Draining("the instance drained before this request finished; send it again")
    return outcome.result()


def _timeout(work: Work, limit_s: float) -> HandlerTimeout:
    return HandlerTimeout(
        f"handler {work.handler!r} did not finish within {limit_s:g} s (THAW_RUN_TIMEOUT_S)",
        handler=work.handler,
    )


def _settle(settled: asyncio.Future[None]) -> None:
    if not settled.done():
        settled.set_result(None)


class Work:
    """What one invocation is doing, for Server-Timing and the job's phase.

    A plain slotted class: one is made per request, and a dataclass with a
    default factory costs several times as much to build.
    """

    __slots__ = (
        "batch_size",
        "handler",
        "leases",
        "outcome",
        "overran",
        "phase",
        "running",
        "settled",
        "spec",
        "stream",
        "timings_ms",
    )

    def __init__(self, spec: HandlerSpec, phase: str = "queued") -> None:
        self.spec = spec
        self.handler = spec.name
        self.phase = phase
        # In phase order (queue, fetch, load, init, warmup, run), as Server-Timing lists them.
        self.timings_ms: dict[str, float] = {}
        self.running = False
        # The models it holds, let go of as its last step, or when it is cancelled.
        self.leases: list[Lease] = []
        # Made by whoever waits for the work; set when the work ends (or, if it
        # never ran, when it was cancelled).
        self.settled: asyncio.Future[None] | None = None
        # The future of its outcome (a task when it had to wait on the loop).
        self.outcome: asyncio.Future[Any] | None = None
        # Its handler ran past THAW_RUN_TIMEOUT_S.
        self.overran = False
        # Requests in the batch it ran in (runtime/dispatch/batcher.py); None: unbatched.
        self.batch_size: int | None = None
        # A generator handler's items (runtime/dispatch/streams.py).
        self.stream: Stream | None = None

    def release(self) -> None:
        """Let go of the models it holds (once)."""
        leases, self.leases = self.leases, []
        for lease in leases:
            lease.release()


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
        caller: Caller,
        health: Health,
    ) -> None:
        """`jobs` builds the job manager with this dispatcher as the runner of the
        jobs it recovers: the two need each other, and neither is patched after."""
        self.settings = settings
        self.health = health
        self.registry = registry
        self.cache = cache
        self.jobs = jobs(self)
        self.estimator = estimator
        self.metrics = metrics
        self.caller = caller
        self.draining = False
        self.pending: dict[str, int] = defaultdict(int)
        # Outcomes of the work in flight: tasks, or futures a handler thread settles.
        self.in_flight: set[asyncio.Future[Any]] = set()
        self.deadlines = Deadlines()
        self.overruns: Overruns[Work] = Overruns(settings.run_timeout_s, self._overran)
        self.batcher = Batcher(
            caller=caller,
            hooks=self,
            run_estimate_s=estimator.run_s,
            margin_s=settings.deadline_margin_s,
        )
        self.streams = Streams()
        for name in registry.handlers:
            self.handler_stats(name)

    def handler_stats(self, name: str) -> HandlerStats:
        found = self.metrics.handlers.get(name)
        if found is None:
            found = self.metrics.handler(name)
            # Read at scrape time, so the warm path does not take the gauge's lock twice.
            self.metrics.queue_depth.labels(name).set_function(lambda: self.pending[name])
        return found

    # ---- the deadline rule ------------------------------------------------------

    async def invoke(
        self,
        name: str,
        event: Any,
        *,
        wait_s: float | None = None,
        respond_async: bool = False,
        request_id: str,
        key_id: str | None = None,
        stream: bool = False,
    ) -> Completed | Accepted | Streaming:
        received = time.monotonic()
        spec = self.registry.handler(name)
        if self.draining:
            raise Draining("this instance is draining and takes no new work")
        stats = self.handler_stats(name)
        if self.pending[name] >= self.settings.max_queue:
            stats.count("throttled")
            raise QueueFull(
                f"handler {name!r} has {self.pending[name]} requests queued "
                f"(limit {self.settings.max_queue})",
                retry_after_s=max(1.0, await self._estimate_s(spec)),
            )
        # The slot is taken before the first await, so that concurrent requests
        # see it: the limit holds however many arrive at once. `_start` keeps it
        # for the work; anything failing before that gives it back.
        self.pending[name] += 1
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
            )
            cold = bool(spec.uses) and not all(map(self.cache.is_ready, spec.uses))
            work = Work(spec, "loading" if cold else "queued")
            run_spec = spec
            if spec.streams or stream:
                work.stream = Stream(spec)
                run_spec = work.stream.bind(spec)
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
            if respond_async or estimate_s > answer_by - time.monotonic():
                # Record the job before starting the work, so the answer is not
                # delayed by what the work does first (a cold load imports torch).
                job = await self._record(spec, event, work, key_id)
                outcome = self._start(run_spec, event, ctx, work)
                started = True
                self._follow(spec, job, outcome, work)
                return Accepted(job, retry_after_s=max(1.0, estimate_s))
            outcome = self._start(run_spec, event, ctx, work)
            started = True
        finally:
            if not started:
                self.pending[name] -= 1
        if stream:
            assert work.stream is not None
            if await self._started_by(work.stream, answer_by):
                stats.count("sync")
                return Streaming(work.stream, work.timings_ms)
        elif outcome.done() or await self._settled_by(work, outcome, answer_by):
            output = _result(outcome)
            stats.count("sync")
            return Completed(output, work.timings_ms, work.batch_size)
        # The estimate was wrong: answer 202 now; the same work goes on.
        job = await self._record(spec, event, work, key_id)
        self._follow(spec, job, outcome, work)
        return Accepted(job, retry_after_s=max(1.0, await self._estimate_s(spec)))

    async def _settled_by(self, work: Work, outcome: asyncio.Future[Any], answer_by: float) -> bool:
        """Wait until `answer_by` at the latest for the work to settle; True when it is done.

        The work settles `work.settled` itself as its last step, so the waiting
        request resumes in the next turn of the loop rather than two turns later
        (outcome set -> its callbacks -> a waiter's callbacks). The outcome's done
        callback settles it too, for work cancelled before it ever ran.
        """
        work.settled = asyncio.get_running_loop().create_future()
        await self.deadlines.wait(work.settled, answer_by)
        return outcome.done()

    async def _started_by(self, stream: Stream, answer_by: float) -> bool:
        """Wait until `answer_by` at the latest for the handler to begin; True when it has."""
        waiter = asyncio.get_running_loop().create_future()
        stream.started.add_done_callback(lambda _: _settle(waiter))
        await self.deadlines.wait(waiter, answer_by)
        return stream.started.done()

    async def _record(self, spec: HandlerSpec, event: Any, work: Work, key_id: str | None) -> Job:
        job = await self.jobs.record(spec.name, event, phase=work.phase, key_id=key_id)
        self.handler_stats(spec.name).count("async")
        return job

    def _follow(
        self, spec: HandlerSpec, job: Job, outcome: asyncio.Future[Any], work: Work
    ) -> None:
        self.jobs.follow(job, outcome, lambda: (work.phase, self._progress(spec, work)))
        if work.stream is not None:
            self.streams.hold(job.id, work.stream)

    async def _ready_s(self, spec: HandlerSpec) -> float:
        ready_s = 0.0
        for name in spec.uses:
            ready_s = max(ready_s, await self.cache.estimate_ready_s(name))
        return ready_s

    async def _estimate_s(self, spec: HandlerSpec) -> float:
        return await self._ready_s(spec) + self.estimator.run_s(spec.name)

    def _progress(self, spec: HandlerSpec, work: Work | None = None) -> dict[str, Any] | None:
        if work is not None and work.running and work.stream is not None:
            return work.stream.partial()
        for name in spec.uses:
            entry = self.cache.entries.get(name)
            if entry is not None and entry.lifecycle.loading and entry.manifest is not None:
                return {
                    "bundle": name,
                    "state": str(entry.lifecycle.state),
                    "bytes": entry.progress_bytes,
                    "total_bytes": entry.manifest.total_bytes,
                }
        return None

    # ---- executing work ---------------------------------------------------------

    def _start(
        self, spec: HandlerSpec, event: Any, ctx: Context, work: Work
    ) -> asyncio.Future[Any]:
        """Start the work now (its queue slot taken already): the future of its outcome."""
        stats = self.handler_stats(spec.name)
        batched = spec.batch is not None
        leases = None if spec.is_async and not batched else self.cache.leases_now(spec.uses)
        if leases is None:
            outcome = eager.start(self._execute(spec, event, ctx, work, stats))
        elif batched:
            work.leases = leases
            self._queued(work, time.monotonic(), {}, stats)
            work.phase = "batching"
            outcome = self.batcher.join(spec, event, ctx, [lease.model for lease in leases], work)
        else:
            work.leases = leases
            outcome = self._in_thread(spec, event, ctx, work, stats)
        work.outcome = outcome
        if work.stream is not None:
            work.stream.attach(outcome)
        if outcome.done():
            self._finished(spec.name, work, stats, outcome)
        else:
            self.in_flight.add(outcome)
            outcome.add_done_callback(partial(self._finished, spec.name, work, stats))
        return outcome

    def _finished(
        self, name: str, work: Work, stats: HandlerStats, outcome: asyncio.Future[Any]
    ) -> None:
        self.in_flight.discard(outcome)
        self.overruns.forget(work)
        self.pending[name] -= 1
        if work.leases:
            # Cancelled: its models are let go of at once, though a handler
            # thread may still run (it keeps its own reference to the model).
            work.release()
        if work.settled is not None:
            _settle(work.settled)
        if not outcome.cancelled() and (exc := outcome.exception()) is not None:
            # A request the handler refused (it raised a 4xx error, e.g. invalid-input)
            # is the caller's fault, not the handler's.
            client = isinstance(exc, ThawError) and exc.status < 500
            stats.count("client_error" if client else "error")

    def _overran(self, work: Work) -> None:
        """`work`'s handler ran past THAW_RUN_TIMEOUT_S: it fails with `handler-timeout`."""
        outcome = work.outcome
        if outcome is None or outcome.done():
            return
        work.overran = True
        limit_s = self.settings.run_timeout_s
        if not work.spec.is_async:
            # Its thread cannot be stopped, and keeps the model and memory it holds.
            self.health.wedge(f"handler {work.handler!r} ran past THAW_RUN_TIMEOUT_S={limit_s:g}")
        if isinstance(outcome, asyncio.Task):
            outcome.cancel()  # `_execute` turns this into HandlerTimeout
        else:
            outcome.set_exception(_timeout(work, limit_s))

    def _in_thread(
        self, spec: HandlerSpec, event: Any, ctx: Context, work: Work, stats: HandlerStats
    ) -> asyncio.Future[Any]:
        """A sync handler whose models are ready, with no task: `_ran_in_thread` finishes it."""
        outcome: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        run_started = self._running(work, time.monotonic(), {}, stats)
        models = [lease.model for lease in work.leases]
        then = partial(self._ran_in_thread, spec, ctx, work, stats, outcome, run_started)
        try:
            self.caller.submit(spec, event, models, ctx, then)
        except Draining as exc:
            outcome.set_exception(exc)
        return outcome

    def _ran_in_thread(
        self,
        spec: HandlerSpec,
        ctx: Context,
        work: Work,
        stats: HandlerStats,
        outcome: asyncio.Future[Any],
        run_started: float,
        done: ThreadOutcome,
    ) -> None:
        if outcome.done():  # cancelled (drain, a job's lost lease): nobody waits for it
            return
        if done.cancelled():  # never ran: the handler threads were shut down
            outcome.cancel()
        elif (exc := done.exception()) is not None:
            outcome.set_exception(caller_error(spec, ctx, exc))
        else:
            self._ran(spec, work, stats, run_started)
            outcome.set_result(done.result())
        if work.leases:
            work.release()
        if work.settled is not None:
            _settle(work.settled)

    def _running(
        self, work: Work, started: float, load_ms: dict[str, float], stats: HandlerStats
    ) -> float:
        """Mark `work` running (its queue and load times recorded); when it started to run."""
        run_started = self._queued(work, started, load_ms, stats)
        work.phase = "running"
        work.running = True
        self.overruns.watch(work, run_started)
        return run_started

    def _queued(
        self, work: Work, started: float, load_ms: dict[str, float], stats: HandlerStats
    ) -> float:
        """Record `work`'s queue and load times, up to now (returned)."""
        now = time.monotonic()
        timings = work.timings_ms
        queue_ms = max(0.0, (now - started) * 1000 - sum(load_ms.values()))
        timings["queue"] = queue_ms
        if load_ms:
            timings.update(load_ms)
        stats.observe_queue(queue_ms / 1000)
        return now

    def _ran(self, spec: HandlerSpec, work: Work, stats: HandlerStats, run_started: float) -> None:
        run_s = time.monotonic() - run_started
        work.timings_ms["run"] = run_s * 1000
        self.estimator.record_run(spec.name, run_s)
        stats.observe_run(run_s)

    async def _execute(
        self, spec: HandlerSpec, event: Any, ctx: Context, work: Work, stats: HandlerStats
    ) -> Any:
        """Work that may wait: for its models (cold), or for an async handler."""
        started = time.monotonic()
        load_ms: dict[str, float] = {}
        try:
            if spec.uses:
                work.phase = "loading"
                cold = [n for n in spec.uses if not self.cache.is_ready(n)]
                if len(spec.uses) == 1:
                    # One bundle needs no gather (which wraps each awaitable in a task).
                    work.leases.append(await self.cache.acquire(spec.uses[0]))
                else:
                    results = await asyncio.gather(
                        *(self.cache.acquire(n) for n in spec.uses), return_exceptions=True
                    )
                    work.leases = [r for r in results if isinstance(r, Lease)]
                    for r in results:
                        if isinstance(r, BaseException):
                            raise r
                for name in cold:
                    phases = self.cache.entries[name].lifecycle.phase_ms
                    for phase in LOAD_PHASES:
                        load_ms[phase] = load_ms.get(phase, 0.0) + phases.get(phase, 0.0)
            models = [lease.model for lease in work.leases]
            if spec.batch is not None:
                self._queued(work, started, load_ms, stats)
                work.phase = "batching"
                return await self.batcher.join(spec, event, ctx, models, work)
            run_started = self._running(work, started, load_ms, stats)
            try:
                output = await self.caller.call(spec, event, models, ctx)
            except ThawError:  # a sync handler's error arrives mapped already
                raise
            except (Exception, SystemExit) as exc:
                # SystemExit too: an async handler calling sys.exit() (as argparse
                # and click do) must not stop the event loop and the server with it.
                raise handler_error(spec, ctx, exc) from exc
            self._ran(spec, work, stats, run_started)
            return output
        except asyncio.CancelledError:
            if work.overran:
                raise _timeout(work, self.settings.run_timeout_s) from None
            raise
        finally:
            if work.leases:
                work.release()
            if work.settled is not None:
                _settle(work.settled)

    # ---- batches (the Batcher's hooks: runtime/dispatch/batcher.py) ----------------

    def batch_started(self, spec: HandlerSpec, members: Sequence[Member], started: float) -> None:
        """Each member runs from now: its wait for the batch timed, its run limit watched."""
        size = len(members)
        batches = self.metrics.batch(spec.name)
        batches.observe_size(size)
        for member in members:
            work: Work = member.work
            wait_s = max(0.0, started - member.queued_at)
            batches.observe_wait(wait_s)
            work.phase = "running"
            work.running = True
            work.batch_size = size
            work.timings_ms["batch"] = wait_s * 1000
            self.overruns.watch(work, started)

    def batch_ran(self, spec: HandlerSpec, members: Sequence[Member], run_s: float) -> None:
        """One run for the estimate (what a request waits for); one per member in stats."""
        self.estimator.record_run(spec.name, run_s)
        stats = self.handler_stats(spec.name)
        for member in members:
            member.work.timings_ms["run"] = run_s * 1000
            stats.observe_run(run_s)

    def member_done(self, member: Member) -> None:
        work: Work = member.work
        if work.leases:
            work.release()
        # Woken here, a turn early, only where the member's outcome is the work's own
        # (a warm request); cold work ends with its task.
        if work.outcome is member.outcome and work.settled is not None:
            _settle(work.settled)

    def can_run(self, handler: str) -> bool:
        """Whether a stored job of `handler` can run here (the JobRunner protocol)."""
        return handler in self.registry.handlers

    def run_job(self, job: Job) -> asyncio.Future[Any]:
        """Run a recovered job's stored input on this instance (the JobRunner protocol)."""
        spec = self.registry.handler(job.handler)
        ctx = Context(request_id=job.id, handler=job.handler, logger=HANDLER_LOG)
        self.pending[spec.name] += 1
        return self._start(spec, job.input, ctx, Work(spec))

    # ---- drain ------------------------------------------------------------------

    async def wait_idle(self) -> None:
        """Returns once no invocation or job of this instance is running."""
        while self.in_flight:
            await asyncio.wait(set(self.in_flight))
        await self.jobs.wait_idle()

    def abort_in_flight(self) -> None:
        """Cut off every piece of work still running now: waiting callers get 503
        `drained`, jobs a retryable `drained` error (the end of a drain's grace)."""
        for outcome in list(self.in_flight):
            outcome.cancel()

    async def drain(self, grace_s: float) -> None:
        """Refuse new work, let in-flight work finish for `grace_s`, abort the rest."""
        self.draining = True
        if self.in_flight:
            await asyncio.wait(set(self.in_flight), timeout=grace_s)
        await self.jobs.abort_all()
        self.abort_in_flight()
        if self.in_flight:
            await asyncio.wait(set(self.in_flight), timeout=5.0)
        await self.cache.unload_all()
