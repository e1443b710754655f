"""Job store calls from the event loop, and the `job-store` health condition they drive.

Every store call runs in a worker thread (stores are synchronous), but for a
`quick` one (a job's record, its end, a lease, a read of one job) that the store
can run at once on the loop (`JobStore.now`: a local SQLite file whose lock is
free), which then costs no thread hop. A call that
raises `StorageUnavailable` turns readiness off (the condition, logged once
when it starts and once when it ends) and starts a probe: a small write now
and then, with back-off, so readiness comes back when the store does even if
nothing else writes. A conditional write that changed something ends the
condition at once.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from runtime.clock import Clock
from runtime.errors import StorageUnavailable
from runtime.jobs.store import JobStore
from runtime.jobs.stores.not_now import NotNow
from runtime.telemetry.health import Health

log = logging.getLogger("thaw.jobs")
T = TypeVar("T")

# The health condition held while the job store cannot serve.
STORE_CONDITION = "job-store"
# Back-off between tries of an outcome write (and of the probe): short at first,
# as most outages are brief; capped so an outcome lands soon after space is freed.
RETRY_FIRST_S = 0.05
RETRY_MAX_S = 2.0


class StoreAccess:
    """`store`'s calls in threads, each reporting to `health` whether the store serves."""

    def __init__(self, store: JobStore, *, owner: str, health: Health, clock: Clock) -> None:
        self.store = store
        self.owner = owner
        self.health = health
        self.clock = clock
        self._probe: asyncio.Task[None] | None = None

    async def read(self, fn: Callable[..., T], *args: Any, quick: bool = False) -> T:
        """A store call in a thread (`quick`: at once if the store can); a store that
        cannot serve turns readiness off."""
        return await self._call(fn, args, quick, writes=False)

    async def write(self, fn: Callable[..., T], *args: Any, quick: bool = False) -> T:
        """A conditional store write; one that changed something (a truthy result)
        proves the store can write again. One that changed nothing proves nothing:
        SQLite writes no page for an UPDATE or DELETE that matches no row."""
        result = await self._call(fn, args, quick, writes=True)
        if result:
            self.serving()
        return result

    async def _call(
        self, fn: Callable[..., T], args: tuple[Any, ...], quick: bool, writes: bool
    ) -> T:
        try:
            if quick:
                done = self.store.now(partial(fn, *args), writes=writes)
                if not isinstance(done, NotNow):
                    return done
            return await asyncio.to_thread(fn, *args)
        except StorageUnavailable as exc:
            self.failing(exc)
            raise

    def serving(self) -> None:
        """A write just succeeded: the store serves."""
        self.health.clear(STORE_CONDITION)

    def failing(self, exc: StorageUnavailable) -> None:
        self.health.report(STORE_CONDITION, exc.message)
        if self._probe is None:
            # In a context of its own: it is no request's, though a request started it.
            self._probe = asyncio.get_running_loop().create_task(
                self._probe_until_writable(), context=contextvars.Context()
            )

    async def _probe_until_writable(self) -> None:
        """While the condition holds, try a small write now and then."""
        delay = RETRY_FIRST_S
        try:
            while STORE_CONDITION in self.health.conditions:
                await self.clock.sleep(delay)
                delay = min(2 * delay, RETRY_MAX_S)
                try:
                    await self.read(self.store.ping, self.owner)
                except StorageUnavailable:
                    continue
                except Exception:
                    log.debug("job store probe failed", exc_info=True)
                    continue
                self.serving()
        finally:
            self._probe = None

    def close(self) -> None:
        """Stop probing."""
        if self._probe is not None:
            self._probe.cancel()
