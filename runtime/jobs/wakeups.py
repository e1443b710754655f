"""The store's notifications on the event loop: what a fleet instance waits on.

A store that can `listen` (PostgreSQL: one listening session per instance,
runtime/jobs/stores/postgres_listen.py) tells every instance of each
committed change of a job. Here they become:

- `wait(job_id, timeout_s)`: a long poll (`GET /jobs/{id}?wait=`) on one
  instance wakes when the job changes on another, instead of reading the
  store in a loop;
- `subscribe(callback)`: each event, on the loop, for whoever acts on them
  (the owner of a job cancelled elsewhere stops its work; an idle instance
  hears of queued work).

A notification is a hint: the row is the truth, and a waiter reads it again.
Until the listening session listens, and while it is down, notifications
are lost: once it listens (`on_gap`: at the start too), every waiter wakes and
every subscriber hears a gap, to read again whatever it waits for. Stores
that cannot listen (SQLite, DynamoDB) give no wake-ups: `supported` is False
and callers keep their own timing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from runtime.clock import Clock

log = logging.getLogger("thaw.jobs")


class Event(Protocol):
    """A committed change of one job (the PostgreSQL store's `JobEvent`)."""

    @property
    def job_id(self) -> str: ...

    @property
    def status(self) -> str: ...

    @property
    def handler(self) -> str: ...


class Stoppable(Protocol):
    def stop(self) -> None: ...


# A subscriber gets each event, or None for a gap (events may have been missed).
Subscriber = Callable[[Event | None], None]


def can_listen(store: object) -> bool:
    return callable(getattr(store, "listen", None))


class Wakeups:
    """One instance's notifications, from the store's listening thread to its loop."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: Stoppable | None = None
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._subscribers: list[Subscriber] = []

    @property
    def supported(self) -> bool:
        """Whether events arrive (a listening store, started)."""
        return self._listener is not None

    def start(self, store: object) -> None:
        """Listen to `store`'s events if it can; on the running loop."""
        if self._listener is not None or not can_listen(store):
            return
        self._loop = asyncio.get_running_loop()
        self._listener = store.listen(self._from_thread, self._gap_from_thread)  # type: ignore[attr-defined]

    def subscribe(self, callback: Subscriber) -> None:
        self._subscribers.append(callback)

    def watch(self, job_id: str) -> asyncio.Event:
        """An event set by each change of `job_id` (and by a gap) until `unwatch`.

        Taken before the job is read, so a change committed between the read and
        the wait is not missed: clear it, read, then wait on it.
        """
        event = asyncio.Event()
        self._waiters.setdefault(job_id, set()).add(event)
        return event

    def unwatch(self, job_id: str, event: asyncio.Event) -> None:
        waiters = self._waiters.get(job_id)
        if waiters is not None:
            waiters.discard(event)
            if not waiters:
                del self._waiters[job_id]

    async def wait(self, job_id: str, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for an event of `job_id` (or a gap); True if one came."""
        event = self.watch(job_id)
        waiter = asyncio.ensure_future(event.wait())
        try:
            return await self.clock.wait_until(waiter, self.clock.monotonic() + timeout_s)
        finally:
            waiter.cancel()
            self.unwatch(job_id, event)

    def waiting(self, job_id: str) -> int:
        """How many waits on `job_id` are in progress (for tests)."""
        return len(self._waiters.get(job_id, ()))

    # ---- from the listening thread -------------------------------------------------

    def _from_thread(self, event: Event) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.deliver, event)

    def _gap_from_thread(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.deliver, None)

    def deliver(self, event: Event | None) -> None:
        """On the loop: wake the waiters of the event's job (all of them for a gap),
        then tell every subscriber."""
        if event is None:
            woken = [e for waiters in self._waiters.values() for e in waiters]
        else:
            woken = list(self._waiters.get(event.job_id, ()))
        for waiter in woken:
            waiter.set()
        for callback in self._subscribers:
            try:
                callback(event)
            except Exception:
                log.exception("a job event subscriber failed")

    def close(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.stop()
        self._loop = None
