"""The memory budget: reservations, admission in arrival order, eviction for room.

Every resident or loading bundle holds a `Reservation`: its weights plus one
request slot per admitted request, and at least one, so the first request of
an idle bundle always fits in what the bundle already holds. Two kinds of
work ask for room:

    a load       its weights and one request slot, before any tensor is read
    a request    one more request slot of a READY bundle already in use

Whoever cannot have room at once queues, and the queue is served in arrival
order: whenever room frees (a request ends, a bundle is unloaded, a load
fails or becomes READY, the limit becomes known) each waiter, oldest first,
is granted if it fits, after evicting idle bundles for it (through the
`Evictor` the cache provides). A waiter that does not fit does not hold up
smaller ones behind it (a bundle that fits loads while a larger one waits for
room), but only `MAX_BYPASS` times: then the queue is served strictly in
order until it is granted, so a large load is never starved by a stream of
small requests. A request that needs no new bytes (its bundle is idle) is
granted at once: it takes no room from anyone. Granting is done here, synchronously, not by
waking waiters to re-check: a waiter resumes admitted, so nobody can be left
waiting while nothing is loading and nothing is in flight (the cache's state
machine test checks exactly that).

A load that could never fit fails at once with `InsufficientMemory`: larger
than the whole budget, or than what pinned bundles leave of it. A queued one
fails too when nothing in flight or loading could ever free
room for it.

Waits (for /models and the job's progress) are timed on the instance's
`Clock` (runtime/clock.py), which tests drive by hand.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from runtime.clock import SYSTEM, Clock
from runtime.errors import InsufficientMemory

# A waiter that does not fit lets later, smaller ones pass it, at most this many
# times; then the queue is served strictly in order until it is granted.
MAX_BYPASS = 16


class Evictor(Protocol):
    """The cache's side of eviction."""

    def evict_for(self, need_bytes: int, exclude: str) -> bool:
        """Evict idle, unpinned bundles (not `exclude`) until `need_bytes` more fit.

        True when anything was evicted. Evicts nothing when evicting every
        idle bundle would still not make room. Evicting calls `unreserve`.
        """
        ...

    def unevictable_bytes(self, exclude: str) -> int:
        """Bytes no eviction will ever free (pinned bundles, at one request each)."""
        ...

    def busy(self) -> bool:
        """Room may come without a request ending: a load is under way (it will become
        evictable, or fail), or a loaded bundle is about to be taken by its waiters."""
        ...


@dataclass
class Reservation:
    """What one bundle holds of the budget."""

    name: str
    weights_bytes: int
    per_request_bytes: int
    admitted: int = 0
    # Draining: no more requests are admitted; those queued go round again.
    closed: bool = False
    # Futures of `idle()` callers, settled when `admitted` drops to 0.
    idle_waiters: list[asyncio.Future[None]] = field(default_factory=list)

    def charge(self) -> int:
        return self.weights_bytes + max(1, self.admitted) * self.per_request_bytes

    def extra_for_one_more(self) -> int:
        """Bytes one more admitted request adds to the charge."""
        return 0 if self.admitted == 0 else self.per_request_bytes


@dataclass(eq=False)
class _Waiter:
    name: str
    # A load asks for a new reservation of `weights_bytes + per_request_bytes`;
    # a request for one more slot of an existing one.
    load: Reservation | None
    future: asyncio.Future[bool]
    since: float
    # Later arrivals granted while this one did not fit.
    bypassed: int = 0


class MemoryBudget:
    """Bytes reserved by bundles and their requests, within `limit` (None: no limit yet)."""

    def __init__(
        self,
        limit: int | None = None,
        *,
        clock: Clock = SYSTEM,
    ) -> None:
        self.limit = limit
        self.clock = clock
        self._evictor: Evictor | None = None
        self._held: dict[str, Reservation] = {}
        self._queue: deque[_Waiter] = deque()
        self._granting = False
        self._again = False

    def bind(self, evictor: Evictor) -> None:
        """The cache that evicts for this budget (set once, by the cache)."""
        self._evictor = evictor

    # ---- views ----------------------------------------------------------------

    def reserved_bytes(self) -> int:
        return sum(r.charge() for r in self._held.values())

    def reservation(self, name: str) -> Reservation | None:
        return self._held.get(name)

    def admitted(self, name: str) -> int:
        held = self._held.get(name)
        return held.admitted if held is not None else 0

    def waiting(self, name: str | None = None) -> int:
        """Requests and loads queued for room (of `name`, or all)."""
        return sum(1 for w in self._queue if name is None or w.name == name)

    def oldest_wait_s(self) -> float:
        """How long the head of the queue has waited (0 when nobody waits)."""
        for waiter in self._queue:
            if not waiter.future.done():
                return max(0.0, self.clock.monotonic() - waiter.since)
        return 0.0

    def admitted_concurrency(self, name: str, weights_bytes: int, per_request_bytes: int) -> int:
        """How many requests of `name` fit beside what the others hold now."""
        assert self.limit is not None and per_request_bytes > 0
        others = sum(r.charge() for r in self._held.values() if r.name != name)
        return max(0, (self.limit - others - weights_bytes) // per_request_bytes)

    # ---- the limit --------------------------------------------------------------

    def set_limit(self, limit: int) -> None:
        self.limit = limit
        self._grant()

    def reconsider(self) -> None:
        """Something the evictor judges by changed (a load became READY, a bundle's
        waiters left): the head of the queue may fit now."""
        if self._queue:
            self._grant()

    # ---- loads ------------------------------------------------------------------

    async def reserve(self, name: str, weights_bytes: int, per_request_bytes: int) -> Reservation:
        """Room for a bundle's weights and one request; waits its turn for it."""
        if name in self._held:
            raise RuntimeError(f"bundle {name!r} already holds a reservation")
        wanted = Reservation(name, weights_bytes, per_request_bytes)
        self._refuse_if_never(wanted)
        granted = await self._wait(name, wanted)
        assert granted
        return self._held[name]

    def close(self, name: str) -> None:
        """Admit no more requests of `name` (it is unloading); queued ones go round again."""
        held = self._held.get(name)
        if held is not None:
            held.closed = True
            self._turn_away(name)

    def unreserve(self, name: str) -> None:
        """The bundle left memory (unloaded, evicted, or its load failed)."""
        held = self._held.pop(name, None)
        if held is None:
            return
        self._turn_away(name)
        self._settle_idle(held)
        self._grant()

    def _turn_away(self, name: str) -> None:
        """Requests queued for a slot of `name`: it is leaving, they go round again."""
        for waiter in list(self._queue):
            if waiter.name == name and waiter.load is None:
                self._queue.remove(waiter)
                if not waiter.future.done():
                    waiter.future.set_result(False)

    # ---- requests ---------------------------------------------------------------

    def admits_now(self, name: str) -> bool:
        """Whether a request of `name` would be admitted now, with no wait (nothing taken)."""
        held = self._held.get(name)
        if held is None or held.closed:
            return False
        extra = held.extra_for_one_more()
        return not (extra and (self._queue or not self._fits(extra)))

    def try_admit(self, name: str) -> bool:
        """Admit one request of `name` now if that needs no wait (the warm path)."""
        if not self.admits_now(name):
            return False
        self._held[name].admitted += 1
        return True

    async def admit(self, name: str) -> bool:
        """One request slot of `name`, in arrival order. False when the bundle left
        memory while the request waited (the caller loads it again)."""
        if self.try_admit(name):
            return True
        held = self._held.get(name)
        if held is None or held.closed:
            return False
        return await self._wait(name, None)

    def release(self, name: str) -> None:
        """A request of `name` ended."""
        held = self._held.get(name)
        if held is None or held.admitted == 0:
            return
        held.admitted -= 1
        if held.admitted == 0:
            self._settle_idle(held)
        if self._queue:
            self._grant()

    async def idle(self, name: str) -> None:
        """Returns once no request of `name` is admitted."""
        held = self._held.get(name)
        if held is None or held.admitted == 0:
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        held.idle_waiters.append(done)
        await done

    # ---- granting ---------------------------------------------------------------

    async def _wait(self, name: str, load: Reservation | None) -> bool:
        future = asyncio.get_running_loop().create_future()
        waiter = _Waiter(name, load, future, self.clock.monotonic())
        self._queue.append(waiter)
        self._grant()
        try:
            return await waiter.future
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise

    def _abandon(self, waiter: _Waiter) -> None:
        """A waiter gave up: take it out of the queue, or give back what it was granted."""
        future = waiter.future
        if future.done() and not future.cancelled() and future.exception() is None:
            if future.result():
                if waiter.load is not None:
                    self.unreserve(waiter.name)
                else:
                    self.release(waiter.name)
            return
        future.cancel()
        if waiter in self._queue:
            self._queue.remove(waiter)
        # The head may have been what blocked the others.
        self._grant()

    def _fits(self, extra: int) -> bool:
        return self.limit is None or self.reserved_bytes() + extra <= self.limit

    def _extra(self, waiter: _Waiter) -> int:
        if waiter.load is not None:
            return waiter.load.charge()
        held = self._held[waiter.name]
        return held.extra_for_one_more()

    def _grant(self) -> None:
        """Serve the queue from its head while the head fits (evicting for it)."""
        if self._granting:
            self._again = True  # an eviction inside the loop freed room: go on there
            return
        self._granting = True
        try:
            while True:
                self._again = False
                self._grant_pass()
                if not self._again:
                    return
        finally:
            self._granting = False

    def _grant_pass(self) -> None:
        queue = self._queue
        # Requests needing no new bytes do not wait behind others, unless one was
        # passed over enough already.
        if all(w.bypassed < MAX_BYPASS for w in queue):
            for waiter in [w for w in queue if w.load is None and not w.future.done()]:
                held = self._held.get(waiter.name)
                if held is not None and not held.closed and held.extra_for_one_more() == 0:
                    queue.remove(waiter)
                    held.admitted += 1
                    waiter.future.set_result(True)
        blocked: list[_Waiter] = []  # earlier waiters that do not fit yet
        for waiter in list(queue):
            if waiter not in queue:
                continue  # turned away by an eviction made for an earlier waiter
            if waiter.future.done():
                queue.remove(waiter)
                continue
            if waiter.load is None and waiter.name not in self._held:
                queue.remove(waiter)
                waiter.future.set_result(False)
                continue
            if any(b.bypassed >= MAX_BYPASS for b in blocked):
                return  # an earlier waiter was passed over enough: strict order now
            if self._room_for(waiter):
                queue.remove(waiter)
                self._take(waiter)
                for earlier in blocked:
                    earlier.bypassed += 1
                continue
            if waiter.load is not None and self._stuck():
                # Nothing in flight or loading will ever free room for it.
                queue.remove(waiter)
                room = self.limit - self.reserved_bytes() if self.limit is not None else 0
                waiter.future.set_exception(
                    self._never(waiter.load, "what bundles that cannot be evicted leave", room)
                )
                continue
            blocked.append(waiter)

    def _room_for(self, waiter: _Waiter) -> bool:
        """Whether `waiter` fits now, evicting idle bundles for it if that makes room."""
        extra = self._extra(waiter)
        while not self._fits(extra):
            evictor = self._evictor
            if evictor is None or not evictor.evict_for(extra, waiter.name):
                return False
        return True

    def _take(self, waiter: _Waiter) -> None:
        if waiter.load is not None:
            self._held[waiter.name] = waiter.load
        else:
            self._held[waiter.name].admitted += 1
        waiter.future.set_result(True)

    def _stuck(self) -> bool:
        """Nothing admitted and nothing loading: no room will ever come but by
        eviction, which just declined."""
        evictor = self._evictor
        busy = evictor.busy() if evictor is not None else False
        return not busy and all(r.admitted == 0 for r in self._held.values())

    def _refuse_if_never(self, wanted: Reservation) -> None:
        if self.limit is None:
            return
        if wanted.charge() > self.limit:
            raise self._never(wanted, "the whole memory budget", self.limit)
        floor = self._evictor.unevictable_bytes(wanted.name) if self._evictor else 0
        if wanted.charge() + floor > self.limit:
            raise self._never(wanted, "what pinned bundles leave of the budget", self.limit - floor)

    def _never(self, wanted: Reservation, room: str, room_bytes: int) -> InsufficientMemory:
        need = wanted.charge()
        return InsufficientMemory(
            f"bundle {wanted.name!r} needs {need} bytes (weights {wanted.weights_bytes}"
            f" + per request {wanted.per_request_bytes}) but {room} is {room_bytes} bytes",
            need_bytes=need,
            budget_bytes=self.limit,
        )

    @staticmethod
    def _settle_idle(held: Reservation) -> None:
        waiters, held.idle_waiters = held.idle_waiters, []
        for done in waiters:
            if not done.done():
                done.set_result(None)
