"""Continuous batching: the sequences of a step-level handler share every decode step.

A handler declared with `decode=Decode(max_sequences)` gives its `Steps`
(runtime/registry.py). Each call is one sequence, and one `Work`
(runtime/dispatch/work.py) like any other invocation: the dispatcher admits
it, leases its models (one request slot of the memory budget: its KV cache),
and hands it here once it holds them. This module only decides which
sequences take the next step and tells each work what happened to it.

    loop                                 prefill call            decode thread
    join(work) -> waiting (arrival order)                        (one per model, while
    _pump: a free slot, no prefill in      a handler thread:      any sequence is held)
      flight -> started(), ------------->  prefill([one]),        loop:
      submit the prefill call              step([one]) (its         take the ready ones
    _begun: its first items delivered <--  first token)             drop those ended from
      still running -> ready ------------------------------------>    outside: release()
    _deliver: each step's items  <----- call_soon_threadsafe ----   step(every one held)
      to each work's own stream;                                    release() finished
      finished -> ran(), succeed(join(items)); an exception -> fail(), that caller only

A new sequence's prompt runs on a handler thread of its own while the held
sequences keep stepping on theirs (torch releases the GIL in its kernels: on
two cores the prefill and the decode steps run side by side): its first token
comes after its own prompt, not after a step of the others, and a long prompt
stalls nobody's next token. One prefill runs at a time per lane, in arrival
order. While a prefill runs, the decode thread's next step waits for it, at
most `Decode.prefill_pause_s` (by default as long as the last step took): the
two threads share one interpreter, and every tensor operation called from
Python takes and gives back the GIL, so a prompt run beside the steps takes
longer than alone, and so does each step
(docs/decisions/0006-prefill-beside-the-decode-steps.md). The pause
makes the new caller's first token come sooner, and costs each held sequence
at most one extra step's wait. Once prefilled, a sequence joins the held ones
between two steps, never in the middle of one. A sequence that ends from
outside (its caller gone, a drain, past THAW_RUN_TIMEOUT_S: the executor times
it from its prefill's hand-over) is dropped, and its cache released, before
the next step begins. A
streaming caller's stream began when its models were leased (the dispatcher's
`_run`): a sequence waiting for a slot is a stream of heartbeats, never a 202 job.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from runtime.clock import Clock
from runtime.dispatch.executor import Executor, Outcome, user_error
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
    # When it joined the lane, and when it was given a slot (on the instance's clock).
    queued_at: float = 0.0
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


def _set_event() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


@dataclass(eq=False)
class _Lane:
    """The sequences of one handler on one set of model objects."""

    key: tuple[str, tuple[int, ...]]
    spec: HandlerSpec
    policy: Decode
    steps: Steps
    # Every member not yet told its end (the loop's), for a thread that fails outside a step.
    members: set[_Member] = field(default_factory=set)
    # Waiting for a slot, in arrival order (on the loop only).
    waiting: deque[_Member] = field(default_factory=deque)
    # A prefill call is in flight (on the loop only).
    prefilling: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Under `lock`: the members given a slot and not yet ended (prefilling, ready or
    # held), the prefilled ones waiting to join the next step, whether the decode
    # thread runs, and the sequences it holds (their caches allocated) as of its last step.
    slots: int = 0
    ready: list[_Member] = field(default_factory=list)
    running: bool = False
    held: int = 0
    # Clear while a prefill call runs; its handler thread sets it as the call ends.
    prefill_idle: threading.Event = field(default_factory=_set_event)

    def idle(self) -> bool:
        with self.lock:
            return not (self.waiting or self.prefilling or self.ready or self.running)


class Decoder:
    """One lane per step-level handler and model; runs their steps on handler threads."""

    def __init__(self, *, executor: Executor, clock: Clock) -> None:
        self._executor = executor
        self._clock = clock
        self._lanes: dict[tuple[str, tuple[int, ...]], _Lane] = {}

    def _of(self, handler: str) -> list[_Lane]:
        return [lane for (name, _), lane in self._lanes.items() if name == handler]

    def running(self, handler: str) -> int:
        """Sequences of `handler` whose caches are held now: prefilled, and stepping
        (as of the last step) or about to join the next step."""
        return sum(lane.held + len(lane.ready) for lane in self._of(handler))

    def busy(self, handler: str) -> bool:
        """Whether a sequence of `handler` joining now would wait for a slot."""
        for lane in self._of(handler):
            with lane.lock:
                if lane.waiting or lane.slots >= lane.policy.max_sequences:
                    return True
        return False

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
            lane = self._lanes[key] = _Lane(key, spec, spec.decode, steps)
        member = _Member(work, event, queued_at=self._clock.monotonic())
        lane.members.add(member)
        lane.waiting.append(member)
        self._pump(lane)

    # ---- on the loop ------------------------------------------------------------

    def _pump(self, lane: _Lane) -> None:
        """Give the first waiting member a free slot and start its prefill (one at a time)."""
        while lane.waiting and not lane.prefilling:
            with lane.lock:
                if lane.slots >= lane.policy.max_sequences:
                    return
            member = lane.waiting.popleft()
            if member.work.outcome.done():  # ended while it waited
                lane.members.discard(member)
                continue
            with lane.lock:
                lane.slots += 1
            lane.prefilling = True
            lane.prefill_idle.clear()
            member.admitted_at = self._clock.monotonic()
            work = member.work
            work.started(member.admitted_at, member.queued_at)
            # A queued job's claim is made on the prefill's thread, its slot held (claims.py).
            claim, work.claim = work.claim, None
            # Its run is watched from its prefill until its work ends, across the steps.
            self._executor.run(
                lane.spec,
                partial(_begin, lane, member),
                partial(self._begun, lane, member),
                claim,
                (work,),
                member.admitted_at,
            )

    def _begun(self, lane: _Lane, member: _Member, done: Outcome) -> None:
        """A prefill call returned: its first items delivered; still running, it joins
        the decode thread's next step."""
        lane.prefilling = False
        lane.prefill_idle.set()  # already, unless the call never ran
        exc = None if done.cancelled() else done.exception()
        if exc is not None or done.cancelled():  # a failure outside the handler's calls
            with lane.lock:
                lane.slots -= 1
            self._fail(lane, member, exc or Draining("this instance is shutting down"))
        elif (outs := done.result()) is None:  # its job's claim lost: the work ended unrun
            with lane.lock:
                lane.slots -= 1
            lane.members.discard(member)
        else:
            self._deliver(lane, outs)
            if outs and outs[-1].error is None and not outs[-1].finished:
                with lane.lock:
                    lane.ready.append(member)
                    start = not lane.running
                    lane.running = True
                if start:
                    self._start(lane)
            else:
                with lane.lock:
                    lane.slots -= 1
        self._pump(lane)
        self._forget_if_idle(lane)

    def _start(self, lane: _Lane) -> None:
        loop = asyncio.get_running_loop()

        def post(outs: list[_Out]) -> None:  # from the decode thread
            loop.call_soon_threadsafe(self._stepped, lane, outs)

        self._executor.run(
            lane.spec, partial(_run_steps, lane, post, self._clock), partial(self._stopped, lane)
        )

    def _stepped(self, lane: _Lane, outs: list[_Out]) -> None:
        """One decode step's outcome: slots may be free for the waiting."""
        self._deliver(lane, outs)
        self._pump(lane)

    def _deliver(self, lane: _Lane, outs: list[_Out]) -> None:
        """Each member told what happened to it."""
        join = lane.spec.join or list
        for out in outs:
            member = out.member
            work = member.work
            if work.outcome.done():  # ended from outside meanwhile
                lane.members.discard(member)
            elif out.error is not None:
                self._fail(lane, member, out.error)
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

    def _fail(self, lane: _Lane, member: _Member, error: BaseException) -> None:
        lane.members.discard(member)
        if not member.work.outcome.done():
            member.work.fail(user_error(lane.spec, member.work.ctx, error))

    def _stopped(self, lane: _Lane, done: Outcome) -> None:
        """The decode thread returned: nothing was left to step, or it failed outside a step."""
        exc = None if done.cancelled() else done.exception()
        if exc is not None or done.cancelled():
            self._fail_all(
                lane, exc or Draining("this instance is shutting down and runs no more handlers")
            )
        self._forget_if_idle(lane)

    def _forget_if_idle(self, lane: _Lane) -> None:
        if lane.idle() and self._lanes.get(lane.key) is lane:
            del self._lanes[lane.key]

    def _fail_all(self, lane: _Lane, error: BaseException) -> None:
        lane.waiting.clear()
        with lane.lock:
            lane.running = False
            lane.ready.clear()
            lane.slots = lane.held = 0
        for member in list(lane.members):
            self._fail(lane, member, error)


# ---- on the handler threads -------------------------------------------------------


def _begin(lane: _Lane, member: _Member) -> list[_Out]:
    """Prefill one member and take its first step (its first token, from its prompt)."""
    outs: list[_Out] = []
    try:
        began = _prefill(lane.steps, [member], outs)
        if began:
            _step(lane.steps, began, outs)
    finally:
        lane.prefill_idle.set()  # the paused step may go (see `_run_steps`)
    return outs


def _run_steps(lane: _Lane, post: Any, clock: Clock) -> None:
    """Step every held sequence together for as long as any is held or ready.

    Before each step the prefilled members join, and those whose work ended from
    outside (cancelled, gone, overran, drained) are dropped and released; a
    prefill in flight is waited for, at most the policy's pause.
    `post(outs)` hands each step's outcome to the loop.
    """
    steps = lane.steps
    fixed_pause = lane.policy.prefill_pause_s
    last_step_s = 0.0
    held: list[_Member] = []
    try:
        while True:
            if held:
                # Before the drop below, so that a caller gone during the pause
                # takes no step after it.
                pause = last_step_s if fixed_pause is None else fixed_pause
                if pause > 0 and not lane.prefill_idle.is_set():
                    lane.prefill_idle.wait(pause)
            with lane.lock:
                held += lane.ready
                lane.ready.clear()
            gone = [m for m in held if m.work.outcome.done()]
            for member in gone:
                steps.release(member.sequence)
            held = [m for m in held if not m.work.outcome.done()] if gone else held
            with lane.lock:
                lane.slots -= len(gone)
                lane.held = len(held)
                if not held and not lane.ready:
                    lane.running = False  # the next one prefilled starts a thread again
                    post([])
                    return
            if not held:
                continue
            outs: list[_Out] = []
            before = len(held)
            started = clock.monotonic()
            held = _step(steps, held, outs)
            last_step_s = clock.monotonic() - started
            with lane.lock:
                lane.slots -= before - len(held)
                lane.held = len(held)
            post(outs)
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
