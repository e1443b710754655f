"""The fleet's queue figures for /metrics, read from the shared store at scrape time.

A scrape (every 15-30 s per instance, by Prometheus) reads them with one
query over the partial index of queued jobs, at most once per `max_age_s`
however many scrapes arrive; concurrent scrapes share one read. A store
without shared queue figures (SQLite, DynamoDB) exports nothing. While the
store cannot serve, the last figures stay: an autoscaler is better served by
a stale count than by a zero that would scale the fleet down.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from runtime.clock import Clock
from runtime.errors import StorageUnavailable
from runtime.jobs.store import DeferredStore
from runtime.telemetry.metrics import FleetQueue

log = logging.getLogger("thaw.jobs")


class FleetQueueReader:
    def __init__(
        self, store: DeferredStore, target: FleetQueue, clock: Clock, *, max_age_s: float = 2.0
    ) -> None:
        self.store = store
        self.target = target
        self.clock = clock
        self.max_age_s = max_age_s
        self._read_at: float | None = None
        self._reading: asyncio.Future[None] | None = None

    async def refresh(self) -> None:
        """Read the figures again unless the last read is recent enough."""
        if self._read_at is not None and self.clock.monotonic() - self._read_at < self.max_age_s:
            return
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read())
        reading = self._reading
        await asyncio.shield(reading)

    async def _read(self) -> None:
        try:
            read = await asyncio.to_thread(self._figures)
        except StorageUnavailable as exc:
            log.debug("fleet queue figures not read: %s", exc)
            read = None
        except Exception:
            log.exception("reading the fleet queue figures failed")
            read = None
        finally:
            self._reading = None
        self._read_at = self.clock.monotonic()
        if read is not None:
            self.target.update(*read)

    def _figures(self) -> tuple[dict[str, tuple[int, float]], float] | None:
        store: Any = self.store.open()
        figures = getattr(store, "queue_figures", None)
        if figures is None:
            return None
        return figures(), self.clock.wall()
