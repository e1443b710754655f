"""Dynamic batching: concurrent requests of one handler share one call.

A handler declared with `batch=Batch(max_size, max_wait_ms)` is called with a
list of events and returns a list of outputs. Each request joins its handler's
queue only once it holds leases on its models, so a batch is formed only from
requests whose models are READY and which the memory budget admitted one by
one: a batch of n holds n request slots (n x per_request_bytes), and batching
can never break the budget. The queue is served in arrival order.

When the head of the queue runs (`due_at`):

    busy         `max_concurrent` batches of the handler run already: the
                 queue waits for one to end, whatever its members' deadlines
                 (capacity is a promise: a GPU that holds one batch, code that
                 is not thread-safe; a caller who cannot wait is answered with
                 a 202 job by the dispatcher, and its member stays queued)
    deadline     a member's answer-by time, less the margin and the handler's
                 estimated run time, has come: it is not held for company
    company      the queue holds as many requests as the handler's last batch
                 did (at most max_size): the company it can expect is there.
                 A request that comes alone after a batch of one (one caller
                 in flight) runs at once: the wait adds no latency
    waited       the oldest has waited max_wait_ms for company that did not
                 come (the load dropped): it goes with what it has

Under load the queue fills while a batch runs and goes as soon as that batch
ends; the next batch's size follows the load.

The batch's outcome is spread to its members: an item returned as an
exception fails only its own caller (InvalidInput: 400; anything else:
500 handler-error); a handler that raises, or returns other than a list of
one output per event, fails every member with handler-error.

This module owns only the queues, when they run and how an outcome is
shared out. Each member is its request's `Work` (runtime/dispatch/work.py),
whose own methods record what a batch means to it (its phase, timings, an
overrun) and settle it (its leases, its waiter, its stats): the batcher hands
the batch's call to the executor with its members as what it runs for (each
watched for THAW_RUN_TIMEOUT_S there), tells each member what happened, and
calls nothing above it.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from runtime.clock import Clock, Timer
from runtime.dispatch import eager
from runtime.dispatch.executor import Executor, Outcome, batch_outputs, user_error
from runtime.dispatch.work import Work
from runtime.errors import HandlerError
from runtime.registry import Batch, HandlerSpec


@dataclass(eq=False, slots=True)
class Member:
    """One request waiting in a batch queue."""

    # Its work: its context, its outcome, what it holds and its bookkeeping.
    work: Work
    event: Any
    # Its models (leased by the request: one admission slot each).
    models: list[Any]
    queued_at: float
    # The latest start of a batch that still answers it in time (inf: no deadline).
    start_by: float

    @property
    def ended(self) -> bool:
        """Its outcome is set: it ended, or was cut off (its settlement may still be
        a callback away)."""
        return self.work.outcome.done()


@dataclass(eq=False)
class _Queue:
    spec: HandlerSpec
    policy: Batch
    waiting: deque[Member] = field(default_factory=deque)
    running: int = 0
    # The size of its last batch: the company a new request can expect.
    expected: int = 1
    timer: Timer | None = None
    # Inside `_serve`: a batch that ends at once (an async handler that never
    # waits) leaves the queue to the `_serve` already running.
    serving: bool = False


def due_at(policy: Batch, waiting: Sequence[Member], running: int, expected: int) -> float:
    """When the head of a queue must run: -inf for now, else a time on the batcher's clock.

    `running`: batches of the handler running now; `expected`: the size of its
    last batch. Pure, so the rule is tested with plain numbers.
    """
    if not waiting or running >= policy.max_concurrent:
        return math.inf  # its end serves the queue again
    deadline = min(member.start_by for member in waiting)
    if len(waiting) >= min(policy.max_size, max(1, expected)):
        return -math.inf
    return min(waiting[0].queued_at + policy.max_wait_s, deadline)


class Batcher:
    """One queue per batched handler; hands each batch, when due, to the executor."""

    def __init__(
        self,
        *,
        executor: Executor,
        run_estimate_s: Callable[[str], float],
        margin_s: float,
        clock: Clock,
    ) -> None:
        """`run_estimate_s(handler)` is the handler's expected run time: a member is
        started no later than its deadline less `margin_s` and that (at least
        `margin_s` again). `clock` is the instance's, the one `Context.deadline_at`
        is on; the queues' timers are armed through it."""
        self._executor = executor
        self._run_estimate_s = run_estimate_s
        self._margin_s = margin_s
        self._clock = clock
        self._queues: dict[str, _Queue] = {}
        self._claiming: set[asyncio.Task[None]] = set()

    def queued(self, handler: str) -> int:
        """Requests of `handler` waiting for a batch now."""
        queue = self._queues.get(handler)
        return len(queue.waiting) if queue is not None else 0

    def running(self, handler: str) -> int:
        """Batches of `handler` running now."""
        queue = self._queues.get(handler)
        return queue.running if queue is not None else 0

    def busy(self, handler: str) -> bool:
        """Whether a request of `handler` joining now would wait for a run slot: the
        handler runs `max_concurrent` batches, or requests queue for one already."""
        queue = self._queues.get(handler)
        return queue is not None and (
            queue.running >= queue.policy.max_concurrent or bool(queue.waiting)
        )

    def holds(self, work: Work) -> bool:
        """Whether `work` waits in a batch queue (it has not started)."""
        queue = self._queues.get(work.handler)
        return queue is not None and any(member.work is work for member in queue.waiting)

    def join(self, work: Work, event: Any, models: list[Any]) -> None:
        """Queue one request whose models are leased; `work` ends with its own outcome."""
        spec = work.spec
        policy = spec.batch
        assert policy is not None, f"handler {spec.name!r} does not batch"
        queue = self._queues.get(spec.name)
        if queue is None:
            queue = self._queues[spec.name] = _Queue(spec, policy)
        now = self._clock.monotonic()
        start_by = math.inf
        deadline_at = work.ctx.deadline_at
        if deadline_at is not None:
            # It must be answered by its deadline less the margin, after a run
            # whose estimate is 0 before the first: at least one margin more.
            run_s = max(self._run_estimate_s(spec.name), self._margin_s)
            start_by = deadline_at - self._margin_s - run_s
        queue.waiting.append(Member(work, event, models, now, start_by))
        self._serve(queue)

    # ---- when batches run ---------------------------------------------------------

    def _serve(self, queue: _Queue) -> None:
        """Run every batch that is due; arm the timer for the next one."""
        if queue.timer is not None:
            queue.timer.cancel()
            queue.timer = None
        if queue.serving:
            return
        queue.serving = True
        try:
            while queue.waiting:
                self._drop_ended(queue)
                due = due_at(queue.policy, queue.waiting, queue.running, queue.expected)
                if due == math.inf:
                    return
                if due > self._clock.monotonic():
                    queue.timer = self._clock.call_at(due, partial(self._serve, queue))
                    return
                self._run(queue)
        finally:
            queue.serving = False

    def _drop_ended(self, queue: _Queue) -> None:
        # Requests cut off while queued (drain, a job that lost its lease, a run
        # limit) are not run; settling, they let go of their models already.
        if any(m.ended for m in queue.waiting):
            queue.waiting = deque(m for m in queue.waiting if not m.ended)

    def _run(self, queue: _Queue) -> None:
        size = min(len(queue.waiting), queue.policy.max_size)
        members = [queue.waiting.popleft() for _ in range(size)]
        queue.running += 1  # the run slot is the batch's from here, claims included
        queue.expected = size
        if any(member.work.claim is not None for member in members):
            task = eager.drive(self._claim_then_run(queue, members))
            if task is not None:  # kept until it ends (the loop holds tasks weakly)
                self._claiming.add(task)
                task.add_done_callback(self._claiming.discard)
        else:
            self._start(queue, members)

    async def _claim_then_run(self, queue: _Queue, members: list[Member]) -> None:
        """Members whose jobs were recorded queued for the fleet (claims.py) are claimed
        by id as their batch is about to run, holding its run slot: one that another
        instance took first ends here unrun, and the batch goes with the rest."""
        for member in members:
            claim, member.work.claim = member.work.claim, None
            if claim is None or member.ended:
                continue
            try:
                await claim()  # a lost claim cancels the member's work
            except Exception as exc:  # the store failed: the job is not this instance's
                member.work.fail(exc)
        members = [member for member in members if not member.ended]
        if members:
            self._start(queue, members)
        else:
            queue.running -= 1
            self._serve(queue)

    def _start(self, queue: _Queue, members: list[Member]) -> None:
        spec = queue.spec
        size = len(members)
        started = self._clock.monotonic()
        for index, member in enumerate(members):
            member.work.started(started, member.queued_at, size, leader=index == 0)
        events = [m.event for m in members]
        ctxs = [m.work.ctx for m in members]
        # Every member leased the same model objects; the batch uses the first's.
        models = members[0].models
        ended = partial(self._ended, queue, members, started)
        call = partial(spec.fn, events, *models, ctxs)
        watched = [m.work for m in members]  # each member's run: the batch's call
        running = self._executor.run(spec, call, ended, None, watched, started)
        if running is None or running.done():
            return

        def abandon(_: asyncio.Future[Any]) -> None:
            # Every member cut off (the run limit, a drain, a job's lost lease):
            # nobody waits for this batch. Cancelled, an async batch ends, and its
            # slot of `max_concurrent` is free again once it has (left running, it
            # would hold that slot for as long as it ran, forever if it hangs). A
            # thread's batch cannot be stopped: it holds its slot until it returns.
            if not running.done() and all(m.ended for m in members):
                running.cancel()

        for member in members:
            member.work.outcome.add_done_callback(abandon)

    # ---- sharing out the outcome -------------------------------------------------

    def _ended(
        self,
        queue: _Queue,
        members: list[Member],
        started: float,
        outcome: Outcome,
    ) -> None:
        queue.running -= 1
        try:
            results = self._results(queue.spec, members, started, outcome)
            for member, result in zip(members, results, strict=True):
                work = member.work
                if member.ended:  # cut off while it ran
                    continue
                if result is None:
                    work.cancel()
                elif isinstance(result, _Failed):
                    work.fail(result.error)
                else:
                    work.succeed(result.value)
        finally:
            # The handler is free: what queued behind this batch may go now.
            self._serve(queue)

    def _results(
        self,
        spec: HandlerSpec,
        members: list[Member],
        started: float,
        outcome: Outcome,
    ) -> list[_Value | _Failed | None]:
        """One result per member (None: cancelled, the handler threads shut down)."""
        if outcome.cancelled():
            return [None] * len(members)
        exc = outcome.exception()
        if exc is None:
            try:
                items = batch_outputs(spec, outcome.result(), len(members))
            except HandlerError as wrong:
                exc = wrong
            else:
                run_s = self._clock.monotonic() - started
                for index, member in enumerate(members):
                    member.work.ran(run_s, leader=index == 0)
                return [
                    _Failed(user_error(spec, m.work.ctx, item))
                    if isinstance(item, BaseException)
                    else _Value(item)
                    for m, item in zip(members, items, strict=True)
                ]
        return [_Failed(error) for error in _batch_errors(spec, members, exc)]


@dataclass(slots=True)
class _Value:
    value: Any


@dataclass(slots=True)
class _Failed:
    error: BaseException


def _batch_errors(
    spec: HandlerSpec, members: list[Member], exc: BaseException
) -> list[BaseException]:
    """Each member's error when the whole batch failed: `handler-error` (the runtime's
    own errors, such as `drained`, as they are), logged once for the batch."""
    first = user_error(spec, members[0].work.ctx, exc, whole_batch=True)
    if first is exc:  # the runtime's own, not the handler's
        return [exc] * len(members)
    errors: list[BaseException] = [first]
    for _ in members[1:]:
        error = HandlerError(first.message, handler=spec.name)
        error.__cause__ = exc
        errors.append(error)
    return errors
