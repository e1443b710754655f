"""Continuous batching: the sequences of a step-level handler share every decode step.

A handler declared with `decode=Decode(max_sequences)` gives its `Steps`
(runtime/registry.py). Each call is one sequence, and one `Work`
(runtime/dispatch/work.py) like any other invocation: the dispatcher admits
it, leases its models (one request slot of the memory budget: its KV cache),
and hands it here once it holds them. This module only decides which
sequences take the next step and tells each work what happened to it.

    loop                                         one handler thread per model
    join(work) -> waiting (arrival order)
       admit while fewer than max_sequences -->  inbox
                                                 while anything is held or in the inbox:
                                                   drop sequences whose work ended
                                                     (cancelled, disconnected, overran,
                                                     drained): release() frees them
                                                   prefill(inbox)
                                                   step(every sequence held)
                                                   release() the finished ones
    deliver(outs)  <-- call_soon_threadsafe ---  (one message per step)
       items -> each work's own stream
       finished -> work.ran(), work.succeed(join(items))
       an exception -> work.fail(), that caller only
       free slots -> admit the next waiting

The steps run back to back on one handler thread for as long as any sequence
is held, so a lone sequence runs as today's private decode loop did: the
thread never waits for the event loop, it posts each step's items to it. New
sequences join between two steps, never in the middle of one, and a sequence
that ends from outside is dropped, and its cache released, before the next
step begins. A sequence waiting for a slot has not begun: a streaming caller's
deadline turns it into a 202 job like any work that has not started.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from runtime.clock import Clock
from runtime.dispatch.calls import HandlerCalls, ThreadOutcome, user_error
from runtime.dispatch.work import Work
from runtime.errors import Draining
from runtime.registry import Decode, HandlerSpec, Steps
from runtime.telemetry.metrics import Metrics


@dataclass(eq=False, slots=True)
class _Member:
    work: Work
    event: Any
    # Its sequence, once prefilled (set on the handler thread).
    sequence: Any = None
    # Every item it yielded, for the output of a caller that asked for no stream.
    items: list[Any] = field(default_factory=list)


@dataclass(slots=True)
class _Out:
    """What one step did to one member."""

    member: _Member
    items: list[Any]
    # What user code raised for this sequence: mapped to Thaw's error on the loop.
    error: BaseException | None = None
    finished: bool = False


@dataclass(eq=False)
class _Lane:
    """The sequences of one handler on one set of model objects."""

    spec: HandlerSpec
    policy: Decode
    steps: Steps
    waiting: deque[_Member] = field(default_factory=deque)
    # Admitted and not yet ended: in the inbox or held by the thread.
    admitted: set[_Member] = field(default_factory=set)
    # Sequences the thread holds (their caches allocated), as of its last step.
    held: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    inbox: list[_Member] = field(default_factory=list)
    running: bool = False


class Decoder:
    """One lane per step-level handler and model; runs their steps on handler threads."""

    def __init__(self, *, calls: HandlerCalls, clock: Clock) -> None:
        self._calls = calls
        self._clock = clock
        self._lanes: dict[tuple[str, tuple[int, ...]], _Lane] = {}

    def _of(self, handler: str) -> list[_Lane]:
        return [lane for (name, _), lane in self._lanes.items() if name == handler]

    def running(self, handler: str) -> int:
        """Sequences of `handler` whose caches are held now (as of the last step)."""
        return sum(lane.held for lane in self._of(handler))

    def waiting(self, handler: str) -> int:
        """Sequences of `handler` waiting for a slot."""
        return sum(len(lane.waiting) for lane in self._of(handler))

    def export(self, handler: str, metrics: Metrics) -> None:
        """Read `handler`'s sequences, running and waiting, at scrape time."""
        sequences = metrics.decode_sequences
        sequences.labels(handler, "running").set_function(lambda: self.running(handler))
        sequences.labels(handler, "waiting").set_function(lambda: self.waiting(handler))

    def join(self, work: Work, event: Any, models: list[Any]) -> None:
        """Queue one sequence whose models are leased; `work` ends with its own outcome."""
        spec = work.spec
        assert spec.decode is not None and spec.make_steps is not None
        key = (spec.name, tuple(map(id, models)))
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane(spec, spec.decode, spec.make_steps(*models))
        lane.waiting.append(_Member(work, event))
        self._admit(key, lane)

    # ---- on the loop ------------------------------------------------------------

    def _admit(self, key: tuple[str, tuple[int, ...]], lane: _Lane) -> None:
        """Move waiting sequences into free slots, in arrival order; start the thread."""
        admitted = lane.admitted
        for member in [m for m in admitted if m.work.outcome.done()]:
            admitted.discard(member)  # ended from outside: the thread drops it
        new: list[_Member] = []
        while lane.waiting and len(admitted) < lane.policy.max_sequences:
            member = lane.waiting.popleft()
            if member.work.outcome.done():  # cut off while it waited
                continue
            member.work.decode_started(self._clock.monotonic())
            admitted.add(member)
            new.append(member)
        if not new:
            if not lane.admitted and not lane.waiting and not lane.running:
                self._lanes.pop(key, None)
            return
        with lane.lock:
            lane.inbox.extend(new)
            start = not lane.running
            lane.running = True
        if not start:
            return
        loop = asyncio.get_running_loop()
        deliver = partial(self._deliver, key, lane)
        try:
            self._calls.submit_call(
                lane.spec,
                partial(_run_steps, lane, partial(loop.call_soon_threadsafe, deliver)),
                partial(self._stopped, key, lane),
            )
        except Draining as exc:
            with lane.lock:
                lane.running = False
                lane.inbox.clear()
            for member in new:
                admitted.discard(member)
                member.work.fail(exc)

    def _deliver(
        self, key: tuple[str, tuple[int, ...]], lane: _Lane, outs: list[_Out], held: int
    ) -> None:
        """One step's outcome, on the loop: each member told what happened to it."""
        lane.held = held
        join = lane.spec.join or list
        for out in outs:
            member = out.member
            work = member.work
            if work.outcome.done():  # ended from outside meanwhile
                lane.admitted.discard(member)
                continue
            if out.error is not None:
                lane.admitted.discard(member)
                work.fail(user_error(lane.spec, work.ctx, out.error))
                continue
            if out.items:
                member.items.extend(out.items)
                if work.stream is not None:
                    for item in out.items:
                        work.stream.push(item)
            if out.finished:
                lane.admitted.discard(member)
                work.ran()
                work.succeed(join(member.items))
        self._admit(key, lane)

    def _stopped(self, key: tuple[str, tuple[int, ...]], lane: _Lane, done: ThreadOutcome) -> None:
        """The lane's thread returned: nothing was held, or it failed outside any step."""
        lane.held = 0
        exc = None if done.cancelled() else done.exception()
        if exc is not None or done.cancelled():
            with lane.lock:
                lane.running = False
                left, lane.inbox = lane.inbox, []
            error = exc or Draining("this instance is shutting down and runs no more handlers")
            for member in [*lane.admitted, *left]:
                lane.admitted.discard(member)
                if not member.work.outcome.done():
                    member.work.fail(user_error(lane.spec, member.work.ctx, error))
        self._admit(key, lane)


# ---- on the handler thread --------------------------------------------------------


def _run_steps(lane: _Lane, post: Any) -> None:
    """Take steps for as long as any sequence is held or waits in the inbox.

    `post(outs, held)` hands each step's outcome to the loop.
    """
    steps = lane.steps
    held: list[_Member] = []
    try:
        while True:
            with lane.lock:
                new, lane.inbox = lane.inbox, []
                if not new and not held:
                    lane.running = False  # a later admission starts a thread again
                    return
            outs: list[_Out] = []
            kept: list[_Member] = []
            for member in held:
                if member.work.outcome.done():
                    steps.release(member.sequence)
                else:
                    kept.append(member)
            held = kept
            if new:
                live = [m for m in new if not m.work.outcome.done()]
                held += _prefill(steps, live, outs)
            if held:
                held = _step(steps, held, outs)
            post(outs, len(held))
    finally:
        for member in held:  # a failure outside any step: nothing is kept
            steps.release(member.sequence)


def _prefill(steps: Steps, new: list[_Member], outs: list[_Out]) -> list[_Member]:
    """Start `new`; the members whose sequences began."""
    if not new:
        return []
    try:
        started = steps.prefill([m.event for m in new], [m.work.ctx for m in new])
        if len(started) != len(new):
            raise TypeError(f"prefill returned {len(started)} sequences for {len(new)} events")
    except Exception as exc:  # the call failed: every sequence in it fails
        outs.extend(_Out(m, [], exc) for m in new)
        return []
    began: list[_Member] = []
    for member, sequence in zip(new, started, strict=True):
        if isinstance(sequence, BaseException):
            outs.append(_Out(member, [], sequence))
        else:
            member.sequence = sequence
            began.append(member)
    return began


def _step(steps: Steps, held: list[_Member], outs: list[_Out]) -> list[_Member]:
    """One step of every held sequence; the members still running after it."""
    try:
        results = steps.step([m.sequence for m in held])
        if len(results) != len(held):
            raise TypeError(f"step returned {len(results)} results for {len(held)} sequences")
    except Exception as exc:
        outs.extend(_Out(m, [], exc) for m in held)
        for member in held:
            steps.release(member.sequence)
        return []
    running: list[_Member] = []
    for member, items in zip(held, results, strict=True):
        if isinstance(items, BaseException):
            steps.release(member.sequence)
            outs.append(_Out(member, [], items))
            continue
        finished = steps.finished(member.sequence)
        if finished:
            steps.release(member.sequence)
        else:
            running.append(member)
        outs.append(_Out(member, list(items), finished=finished))
    return running
