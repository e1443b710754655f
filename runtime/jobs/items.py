"""A streaming job's items in the shared store, for followers on any instance.

The owner of a generator handler's job writes its items as they come
(`JobItems.start`: one task per job), in batches: whatever the stream made
since the last write, at most every `flush_s`, each batch one statement with
its notification, fenced by the run (`attempt`) as a finish is. The outcome is
recorded only once every item is written (`flushed`), so a follower that sees
the job final reads all its items before the final event.

A follower on any instance (`follow`) watches the job's notifications, then
reads the job and the items after the last index it holds (`Last-Event-ID`),
again at each notification (an owner's batch, its finish, a gap in the
listening session) or after `idle_s` without one: in order, without gaps (a
read stops at the first index not written) or repeats (it reads from the index
after the last it gave). A run taken over by another instance starts its items
again: the follower goes on from the index it holds, in the new run's items.

Only a store that keeps items (PostgreSQL: `append_items`, `items_after`)
takes part; with SQLite or DynamoDB a job is followed on the instance that
runs it, from its memory (runtime/dispatch/streams.py), as before.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Protocol

import orjson

from runtime.clock import Clock
from runtime.errors import StorageUnavailable
from runtime.jobs.job import Job
from runtime.jobs.leases import LocalJob, wait_set
from runtime.jobs.store_access import RETRY_FIRST_S, RETRY_MAX_S, StoreAccess
from runtime.jobs.wakeups import Wakeups
from runtime.wire.outputs import JSON_OPTIONS

log = logging.getLogger("thaw.jobs")

# At most one batch of a job's items per this long: a stream of 50 tokens a second
# is 20 notifying writes a second, not 50.
FLUSH_S = 0.05
# Items per write, and per read.
BATCH = 1000
# Without wake-ups (a store that cannot listen), a follower reads this often.
POLL_S = 0.1


class ItemSource(Protocol):
    """A run's items as they are made (the dispatcher's `Stream`)."""

    items: list[Any]
    ended: bool

    async def wait_change(self, seen: int, timeout_s: float) -> bool: ...


class JobItems:
    """Writes the held jobs' items to the store; reads any job's for a follower."""

    def __init__(
        self, access: StoreAccess, *, owner: str, clock: Clock, give_up: asyncio.Event
    ) -> None:
        self.access = access
        self.owner = owner
        self.clock = clock
        # Set when a drain stops waiting for the store (the manager's): writes stop.
        self.give_up = give_up
        self.flush_s = FLUSH_S
        # The opened store, when it keeps items (set by runtime/jobs/fleet.py).
        self.store: Any = None

    def start(self, local: LocalJob, source: ItemSource | None) -> None:
        """Write `source`'s items for `local` (claimed: its run's attempt is known)."""
        if source is None or self.store is None or local.writer is not None:
            return
        local.writer = asyncio.get_running_loop().create_task(
            self._write(local, source), context=contextvars.copy_context()
        )

    async def flushed(self, local: LocalJob) -> None:
        """Returns once every item of `local`'s run is written (or cannot be)."""
        if local.writer is not None:
            await asyncio.shield(local.writer)

    async def _write(self, local: LocalJob, source: ItemSource) -> None:
        job = local.job
        written, delay = 0, RETRY_FIRST_S
        try:
            while not local.released:
                if len(source.items) <= written:
                    if source.ended:
                        return
                    await source.wait_change(written, 60.0)
                    continue
                batch = source.items[written : written + BATCH]
                encoded = [orjson.dumps(item, option=JSON_OPTIONS) for item in batch]
                try:
                    kept = await self.access.write(
                        self.store.append_items, job.id, self.owner, job.attempts, written, encoded
                    )
                except StorageUnavailable:
                    if await wait_set(self.clock, self.give_up, delay):
                        return  # a drain gave up on the store: the job runs again elsewhere
                    delay = min(2 * delay, RETRY_MAX_S)
                    continue
                if not kept:
                    return  # no longer this run's job: its heartbeat or finish finds out
                written, delay = written + len(batch), RETRY_FIRST_S
                if self.flush_s > 0 and not source.ended:
                    await self.clock.sleep(self.flush_s)
        except TypeError as exc:
            # An item that is not JSON: the stream's own followers are told so.
            log.warning("job %s: its items are not written on from %d: %s", job.id, written, exc)
        except Exception:
            log.exception("job %s: writing its items failed", job.id)

    async def follow(
        self,
        job_id: str,
        start: int,
        idle_s: float,
        get: Callable[[], Awaitable[Job]],
        wakeups: Wakeups,
    ) -> AsyncGenerator[list[Any] | Job, None]:
        """Batches of items from index `start` on (an empty one after `idle_s` without
        any), then the job once it is final. `get()` reads the job (UnknownJob raised
        for one that is not the caller's)."""
        changed = wakeups.watch(job_id) if wakeups.supported else None
        try:
            while True:
                if changed is not None:
                    changed.clear()
                job = await get()
                # Read after the job: items are written before the outcome, so once
                # the job reads final, this read has them all.
                while True:
                    batch = await self.access.read(self.store.items_after, job_id, start, BATCH)
                    if not batch:
                        break
                    start += len(batch)
                    yield batch
                    if len(batch) < BATCH:
                        break
                if job.status.final:
                    yield job
                    return
                if changed is None:
                    await self.clock.sleep(POLL_S)
                elif not await wait_set(self.clock, changed, idle_s):
                    yield []
        finally:
            if changed is not None:
                wakeups.unwatch(job_id, changed)
