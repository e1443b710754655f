"""Continuous batching: the sequences of a step-level handler share every decode step.

A handler declared with `decode=Decode(max_sequences)` gives its `Steps`
(runtime/registry.py). Each call is one sequence, and one `Work`
(runtime/dispatch/work.py) like any other invocation: the dispatcher admits
it, leases its models (one request slot of the memory budget: its KV cache),
and hands it here once it holds them. This module only decides which
sequences take the next step and tells each work what happened to it.

    loop                                         one handler thread per model
    join(work) -> waiting (arrival order) -->
                                                 while anything is held or waiting:
                                                   drop sequences whose work ended
                                                     (cancelled, disconnected, overran,
                                                     drained): release() frees them
                                                   admit waiting ones to free slots:
                                                     prefill(the new ones)
                                                   step(new and held together)
                                                   release() the finished ones
    deliver(outs)  <-- call_soon_threadsafe ---  (one post per step)
       admitted -> work.decode_started() (its stream begins)
       items -> each work's own stream
       finished -> work.ran(), work.succeed(join(items))
       an exception -> work.fail(), that caller only

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
    # When the handler thread gave it a slot (on the instance's clock).
    admitted_at: float = 0.0
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
    clock: Clock
    # Every member not yet told its end (the loop's), for a thread that fails outside a step.
    members: set[_Member] = field(default_factory=set)
    # Sequences the thread holds (their caches allocated), as of its last step.
    held: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Waiting for a slot, in arrival order (appended on the loop, taken by the thread).
    waiting: deque[_Member] = field(default_factory=deque)
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
            steps = spec.make_steps(*models)
            lane = self._lanes[key] = _Lane(spec, spec.decode, steps, self._clock)
        member = _Member(work, event)
        lane.members.add(member)
        with lane.lock:
            lane.waiting.append(member)
            start = not lane.running
            lane.running = True
        if start:
            self._start(key, lane)

    # ---- on the loop ------------------------------------------------------------

    def _start(self, key: tuple[str, tuple[int, ...]], lane: _Lane) -> None:
        loop = asyncio.get_running_loop()
        deliver = partial(self._deliver, lane)
        try:
            self._calls.submit_call(
                lane.spec,
                partial(_run_steps, lane, partial(loop.call_soon_threadsafe, deliver)),
                partial(self._stopped, key, lane),
            )
        except Draining as exc:
            self._fail_all(lane, exc)

    def _deliver(self, lane: _Lane, admitted: list[_Member], outs: list[_Out], held: int) -> None:
        """One step's outcome, on the loop: each member told what happened to it."""
        lane.held = held
        for member in admitted:
            if not member.work.outcome.done():
                member.work.decode_started(member.admitted_at)
        join = lane.spec.join or list
        for out in outs:
            member = out.member
            work = member.work
            if work.outcome.done():  # ended from outside meanwhile
                lane.members.discard(member)
            elif out.error is not None:
                lane.members.discard(member)
                work.fail(user_error(lane.spec, work.ctx, out.error))
            else:
                if out.items:
                    member.items.extend(out.items)
                    if work.stream is not None:
                        for item in out.items:
                            work.stream.push(item)
                if out.finished:
                    lane.members.discard(member)
                    work.ran()
                    work.succeed(join(member.items))
        # Members cut off from outside need no more telling.
        for member in [m for m in lane.members if m.work.outcome.done()]:
            lane.members.discard(member)

    def _stopped(self, key: tuple[str, tuple[int, ...]], lane: _Lane, done: ThreadOutcome) -> None:
        """The lane's thread returned: nothing was left to step, or it failed outside a step."""
        exc = None if done.cancelled() else done.exception()
        if exc is not None or done.cancelled():
            lane.held = 0
            with lane.lock:
                lane.running = False
                lane.waiting.clear()
            self._fail_all(
                lane, exc or Draining("this instance is shutting down and runs no more handlers")
            )
        with lane.lock:
            idle = not lane.running and not lane.waiting
        if idle and self._lanes.get(key) is lane:
            del self._lanes[key]

    def _fail_all(self, lane: _Lane, error: BaseException) -> None:
        with lane.lock:
            lane.running = False
            lane.waiting.clear()
        for member in list(lane.members):
            lane.members.discard(member)
            if not member.work.outcome.done():
                member.work.fail(user_error(lane.spec, member.work.ctx, error))


# ---- on the handler thread --------------------------------------------------------


def _admit(lane: _Lane, held: int) -> list[_Member] | None:
    """Members given the free slots, in arrival order (those ended while they waited
    are dropped); None when there is nothing left to step: the thread ends."""
    new: list[_Member] = []
    with lane.lock:
        while lane.waiting and held + len(new) < lane.policy.max_sequences:
            member = lane.waiting.popleft()
            if not member.work.outcome.done():
                new.append(member)
        if not new and not held:
            lane.running = False  # the next join starts a thread again
            return None
    now = lane.clock.monotonic()
    for member in new:
        member.admitted_at = now
    return new


def _run_steps(lane: _Lane, post: Any) -> None:
    """Take steps for as long as any sequence is held or waits for a slot.

    Each iteration starts the sequences given a slot (`prefill`, all of them in
    one call), then takes one step of every sequence, new and held together: the
    handler may run the new ones' prompts in that step beside the others' next
    tokens (SmolLM2 does, in chunks), so a prompt costs the running sequences no
    step of their own. `post(admitted, outs, held)` hands each outcome to the loop.
    """
    steps = lane.steps
    held: list[_Member] = []
    try:
        while True:
            kept: list[_Member] = []
            for member in held:
                if member.work.outcome.done():  # cancelled, gone, overran, drained
                    steps.release(member.sequence)
                else:
                    kept.append(member)
            held = kept
            new = _admit(lane, len(held))
            if new is None:
                post([], [], 0)
                return
            outs: list[_Out] = []
            held += _prefill(steps, new, outs)
            if held:
                held = _step(steps, held, outs)
            post(new, outs, len(held))
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
