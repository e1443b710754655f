"""The model cache: entries, admission, leases, the memory budget and eviction.

`ModelCache` is the face the dispatcher, the app and the instance use: it keeps
one `Entry` per bundle name (runtime/models/entry.py), admits requests on READY
bundles and hands them a `Lease`, and starts loads through its `Loader`
(runtime/models/loading.py: single flight, the load pipeline, retry back-off).

Memory: the budget counts each resident or loading bundle's weights plus its
per-request bytes for every admitted request (at least one). Loads make room
by evicting idle, unpinned bundles in the policy's order (runtime/models/eviction.py;
cost-aware by default), and the policy hears of every load, hit and
eviction; a request beyond what fits waits for a slot. A bundle that can
never fit fails at once.

Time for last use, reload cost and back-off comes from `clock` (a seam: the
eviction simulator passes a simulated clock).

All entry state is changed on the event loop thread only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from runtime.bundles.manifest import Manifest
from runtime.bundles.sources.source import BundleSource
from runtime.errors import InsufficientMemory, UnknownBundle
from runtime.metrics import Metrics
from runtime.models import weights as weights_mod
from runtime.models.entry import Entry
from runtime.models.estimate import Estimator
from runtime.models.eviction import DensityPolicy, EvictionPolicy
from runtime.models.lifecycle import State
from runtime.models.loading import Loader, Runner
from runtime.registry import Registry

log = logging.getLogger("thaw.cache")


class Lease:
    """A model in use by one request; releasing it frees its admission slot."""

    def __init__(self, cache: ModelCache, entry: Entry) -> None:
        self._cache = cache
        self.entry = entry
        self.model = entry.model
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._cache._release(self.entry)


class ModelCache:
    """Bundles by name: loaded once, admitted within the memory budget, evicted when idle."""

    def __init__(
        self,
        *,
        source: BundleSource,
        registry: Registry,
        estimator: Estimator,
        metrics: Metrics,
        runner: Runner,
        device: str = "",
        memory_budget: int = 0,
        retry_backoff_s: float = 1.0,
        policy: EvictionPolicy | None = None,
        pinned: tuple[str, ...] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = source
        self.registry = registry
        self.estimator = estimator
        self.metrics = metrics
        self.runner = runner
        self.requested_device = device
        self.device: str | None = None
        self.configured_budget = memory_budget
        self.budget: int | None = memory_budget or None
        self.retry_backoff_s = retry_backoff_s
        self.policy: EvictionPolicy = policy if policy is not None else DensityPolicy()
        self.clock = clock
        self.entries: dict[str, Entry] = {}
        self._changed = asyncio.Condition()
        # Coroutines parked in `_changed.wait()`: a release notifies only when
        # someone waits, so the warm path does not start a task per request.
        self._waiting = 0
        self._pinned = set(pinned)
        self._hit_counters: dict[str, Any] = {}
        # Manifest reads in flight: a burst of cold requests estimating one
        # bundle shares a single read instead of queueing one thread each.
        self._manifest_reads: dict[str, asyncio.Future[Manifest]] = {}
        self._loader = Loader(self)

    # ---- lookup -------------------------------------------------------------

    def entry(self, name: str) -> Entry:
        entry = self.entries.get(name)
        if entry is None:
            if self.registry.builder(name) is None:
                raise UnknownBundle(f"no builder for bundle {name!r}")
            entry = Entry(name=name, pinned=name in self._pinned)
            self.entries[name] = entry
        return entry

    def is_ready(self, name: str) -> bool:
        entry = self.entries.get(name)
        return entry is not None and entry.lifecycle.state is State.READY

    def reserved_bytes(self) -> int:
        return sum(e.charge() for e in self.entries.values())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()
        self.metrics.resident_bytes.set(self.reserved_bytes())

    async def _wait_changed(self) -> None:
        """`_changed.wait()` (the caller holds the condition), counted for `_release`."""
        self._waiting += 1
        try:
            await self._changed.wait()
        finally:
            self._waiting -= 1

    def _hit_counter(self, name: str) -> Any:
        counter = self._hit_counters.get(name)
        if counter is None:  # labels() locks and hashes per call; look it up once
            counter = self._hit_counters[name] = self.metrics.cache_events.labels(name, "hit")
        return counter

    # ---- estimates ----------------------------------------------------------

    async def manifest_of(self, name: str) -> Manifest:
        entry = self.entry(name)
        if entry.manifest is not None:
            return entry.manifest
        read = self._manifest_reads.get(name)
        if read is None:
            read = asyncio.ensure_future(asyncio.to_thread(self.source.manifest, name))
            self._manifest_reads[name] = read
            read.add_done_callback(partial(self._manifest_read, entry))
        # Shield: one caller giving up must not cancel the read the others wait for.
        return await asyncio.shield(read)

    def _manifest_read(self, entry: Entry, read: asyncio.Future[Manifest]) -> None:
        del self._manifest_reads[entry.name]
        if read.cancelled() or read.exception() is not None:
            return  # every waiter got the error; the next call reads again
        if entry.manifest is None:
            entry.manifest = read.result()

    async def estimate_ready_s(self, name: str) -> float:
        """Seconds until `name` is READY (0 when it is)."""
        return await self._loader.estimate_ready_s(self.entry(name))

    # ---- acquire / release --------------------------------------------------

    async def acquire(self, name: str) -> Lease:
        """Wait until `name` is READY and a request slot fits the budget."""
        entry = self.entry(name)
        while True:
            state = entry.lifecycle.state
            if state is State.READY:
                # The common case (room for one more request) needs no await.
                if self._fits_now(entry) or await self._admit(entry):
                    return self._lease(entry)
                continue
            await self.ensure_loading(entry)
            task = entry.task
            if task is not None:
                entry.waiting += 1
                try:
                    # Shield: a caller giving up (deadline) must not cancel the shared load.
                    await asyncio.shield(task)
                finally:
                    entry.waiting -= 1
            elif entry.lifecycle.state is State.DRAINING:
                async with self._changed:
                    await self._wait_changed()

    def leases_now(self, names: Sequence[str]) -> list[Lease] | None:
        """Leases of all of `names` at once; None where `acquire` would have to wait.

        All or none: a request that must wait for one of its models takes none
        of them here, so it is not counted as a hit twice.
        """
        entries = []
        for name in names:
            entry = self.entries.get(name)
            if entry is None or entry.lifecycle.state is not State.READY:
                return None
            if not self._fits_now(entry):
                return None
            entries.append(entry)
        return [self._lease(entry) for entry in entries]

    def _lease(self, entry: Entry) -> Lease:
        entry.inflight += 1
        entry.hits += 1
        entry.last_used_at = self.clock()
        entry.last_used_wall = time.time()
        self._hit_counter(entry.name).inc()
        self.policy.on_hit(entry.candidate(), entry.last_used_at)
        return Lease(self, entry)

    def _fits_now(self, entry: Entry) -> bool:
        """One more request of `entry` is covered by what it already holds."""
        return entry.inflight == 0 or entry.per_request_bytes == 0 or self.budget is None

    async def _admit(self, entry: Entry) -> bool:
        """True when one more request of `entry` fits; waits for room otherwise."""
        if self._fits_now(entry):
            return True
        assert self.budget is not None
        async with self._changed:
            while entry.lifecycle.state is State.READY:
                if self.reserved_bytes() + entry.per_request_bytes <= self.budget:
                    return True
                if await self._evict_for(entry.per_request_bytes, exclude=entry.name):
                    continue
                await self._wait_changed()
        return False

    def _release(self, entry: Entry) -> None:
        entry.inflight -= 1
        entry.last_used_at = self.clock()
        entry.last_used_wall = time.time()
        if self._waiting:
            asyncio.get_running_loop().create_task(self._notify())
        elif entry.per_request_bytes:
            # Nobody to wake, but the admitted request's bytes left the budget.
            self.metrics.resident_bytes.set(self.reserved_bytes())

    # ---- loading (runtime/models/loading.py) --------------------------------------

    async def ensure_loading(self, entry: Entry) -> None:
        """Start the single-flight load of `entry` unless it is loading or loaded."""
        await self._loader.ensure_loading(entry)

    async def wait_built(self, name: str) -> Any:
        """The model object of `name` once built (INITIALIZED or later), loading it if needed."""
        return await self._loader.wait_built(name)

    # ---- eviction -----------------------------------------------------------

    async def _make_room(self, entry: Entry) -> None:
        assert entry.manifest is not None and self.budget is not None
        need = entry.manifest.weights_bytes + entry.manifest.per_request_bytes
        if need > self.budget:
            raise InsufficientMemory(
                f"bundle {entry.name!r} needs {need} bytes (weights "
                f"{entry.manifest.weights_bytes} + per request {entry.manifest.per_request_bytes}) "
                f"but the whole memory budget is {self.budget} bytes",
                need_bytes=need,
                budget_bytes=self.budget,
            )
        async with self._changed:
            while self.reserved_bytes() + need > self.budget:
                if await self._evict_for(need, exclude=entry.name):
                    continue
                # Everything resident is busy or pinned: wait for a release.
                await self._wait_changed()
            entry.reserved = True
        self.metrics.resident_bytes.set(self.reserved_bytes())

    async def _evict_for(self, need: int, *, exclude: str) -> bool:
        """Evict idle bundles until `need` more bytes fit; True if anything was evicted."""
        assert self.budget is not None
        now = self.clock()
        candidates = [
            e.candidate()
            for e in self.entries.values()
            if e.name != exclude
            and e.lifecycle.state is State.READY
            and e.inflight == 0
            and e.waiting == 0
            and not e.pinned
        ]
        if self.reserved_bytes() + need - sum(c.size_bytes for c in candidates) > self.budget:
            # Evicting every idle bundle would still not make room: evict none
            # (each would only have to be loaded again) and wait for releases.
            return False
        evicted = False
        for candidate in self.policy.order(candidates, now):
            if self.reserved_bytes() + need <= self.budget:
                break
            self._unload_now(self.entries[candidate.name], reason="evicted")
            self.policy.on_evict(candidate, now)
            evicted = True
        return evicted

    def _unload_now(self, entry: Entry, *, reason: str) -> None:
        """READY and idle -> UNLOADED, synchronously (the caller holds no await)."""
        entry.lifecycle.advance(State.DRAINING)
        entry.model = None
        entry.built.clear()
        entry.reserved = False
        entry.lifecycle.advance(State.UNLOADED)
        if self.device is not None:
            weights_mod.release(self.device)
        if reason == "evicted":
            self.metrics.cache_events.labels(entry.name, "eviction").inc()
        log.info("%s %s", reason, entry.name)

    async def unload(self, name: str) -> None:
        """Drain `name` (in-flight requests finish), then free its memory."""
        entry = self.entry(name)
        if entry.task is not None:
            try:
                await asyncio.shield(entry.task)
            except Exception:  # the load failed: nothing to unload
                return
        if entry.lifecycle.state is not State.READY:
            return
        entry.lifecycle.advance(State.DRAINING)
        async with self._changed:
            while entry.inflight > 0:
                await self._wait_changed()
        entry.model = None
        entry.built.clear()
        entry.reserved = False
        entry.lifecycle.advance(State.UNLOADED)
        if self.device is not None:
            await asyncio.to_thread(weights_mod.release, self.device)
        await self._notify()
        log.info("unloaded %s", name)

    async def unload_all(self) -> None:
        await asyncio.gather(*(self.unload(n) for n in list(self.entries)), return_exceptions=True)

    # ---- views --------------------------------------------------------------

    def describe(self, entry: Entry) -> dict[str, Any]:
        view = entry.view()
        if entry.manifest is not None:
            view["estimate"] = self.estimator.describe(entry.manifest)
            view["memory"] = self.memory_plan(entry)
        return view

    def memory_plan(self, entry: Entry) -> dict[str, Any]:
        assert entry.manifest is not None
        plan: dict[str, Any] = {
            "weights_bytes": entry.weights_bytes,
            "per_request_bytes": entry.per_request_bytes,
            "budget_bytes": self.budget,
        }
        if self.budget is not None and entry.per_request_bytes > 0:
            others = sum(e.charge() for e in self.entries.values() if e is not entry)
            room = self.budget - others - entry.weights_bytes
            plan["admitted_concurrency"] = max(0, room // entry.per_request_bytes)
        else:
            plan["admitted_concurrency"] = None  # bounded by the queue, not memory
        return plan
