"""The model cache: entries, leases, eviction and unload.

`ModelCache` is the face the dispatcher, the app and the instance use: it keeps
one `Entry` per bundle name (runtime/models/entry.py), hands requests a
`Lease` on READY bundles once the memory budget admits them
(runtime/models/budget.py: reservations, admission in arrival order), and
starts loads through its `Loader` (runtime/models/loading.py: single flight,
the load pipeline, retry back-off, no-progress deadlines).

It is also the budget's `Evictor`: when a load or a request needs room, the
budget asks it to evict idle, unpinned bundles in the policy's order
(runtime/models/eviction.py; cost-aware by default), and the policy hears of
every load, hit and eviction.

Time for last use, reload cost and back-off comes from `clock`, the
instance's one `Clock` (runtime/clock.py; the eviction simulator passes a
simulated one, tests a `ManualClock`).

All entry state is changed on the event loop thread only.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from functools import partial
from typing import Any

from runtime.bundles.manifest import Manifest
from runtime.bundles.sources.source import BundleSource
from runtime.clock import SYSTEM, Clock
from runtime.errors import UnknownBundle
from runtime.models import weights as weights_mod
from runtime.models.budget import MemoryBudget
from runtime.models.entry import Entry
from runtime.models.estimate import Estimator
from runtime.models.eviction import DensityPolicy, EvictionPolicy
from runtime.models.lifecycle import Lifecycle, State
from runtime.models.loading import Loader, WarmUp
from runtime.models.phases import PhaseLimits
from runtime.models.weights import host
from runtime.registry import Registry
from runtime.telemetry.health import Health
from runtime.telemetry.metrics import Metrics

log = logging.getLogger("thaw.cache")


class Lease:
    """A model in use by one request; releasing it frees its admission slot."""

    __slots__ = ("_cache", "_released", "entry", "model")

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
        warm_up: WarmUp,
        device: str = "",
        memory_budget: int = 0,
        retry_backoff_s: float = 1.0,
        policy: EvictionPolicy | None = None,
        pinned: tuple[str, ...] = (),
        limits: PhaseLimits | None = None,
        health: Health | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        self.source = source
        self.registry = registry
        self.estimator = estimator
        self.metrics = metrics
        self.policy: EvictionPolicy = policy if policy is not None else DensityPolicy()
        self.clock = clock
        # Read on every lease and release: looked up once.
        self._monotonic = clock.monotonic
        self._wall = clock.wall
        self.entries: dict[str, Entry] = {}
        self.budget = MemoryBudget(memory_budget or None, clock=clock)
        self.budget.bind(self)
        self._pinned = set(pinned)
        self._hit_counters: dict[str, Any] = {}
        # Manifest reads in flight: a burst of cold requests estimating one
        # bundle shares a single read instead of queueing one thread each.
        self._manifest_reads: dict[str, asyncio.Future[Manifest]] = {}
        self._loader = Loader(
            source=source,
            registry=registry,
            estimator=estimator,
            metrics=metrics,
            budget=self.budget,
            policy=self.policy,
            warm_up=warm_up,
            entry_of=self.entry,
            requested_device=device,
            retry_backoff_s=retry_backoff_s,
            limits=limits if limits is not None else PhaseLimits(),
            health=health if health is not None else Health(),
            clock=clock,
        )
        # Read at scrape time, not set on every request.
        metrics.resident_bytes.set_function(self.budget.reserved_bytes)
        metrics.budget_bytes.set_function(self._budget_limit)

    def _budget_limit(self) -> float:
        limit = self.budget.limit
        return math.nan if limit is None else float(limit)

    # ---- lookup -------------------------------------------------------------

    def entry(self, name: str) -> Entry:
        entry = self.entries.get(name)
        if entry is None:
            if self.registry.builder(name) is None:
                raise UnknownBundle(f"no builder for bundle {name!r}")
            lifecycle = Lifecycle(clock=self.clock)
            entry = Entry(name=name, lifecycle=lifecycle, pinned=name in self._pinned)
            self.entries[name] = entry
        return entry

    def is_ready(self, name: str) -> bool:
        entry = self.entries.get(name)
        return entry is not None and entry.lifecycle.state is State.READY

    @property
    def device(self) -> str | None:
        """The device models load onto; None until the first load resolved it."""
        return self._loader.device

    def reserved_bytes(self) -> int:
        return self.budget.reserved_bytes()

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
        entry = self.entry(name)
        if entry.lifecycle.state is State.READY:
            return 0.0
        return self._loader.estimate_ready_s(entry, await self.manifest_of(name))

    # ---- acquire / release --------------------------------------------------

    async def acquire(self, name: str) -> Lease:
        """Wait until `name` is READY and the budget admits one more request of it."""
        entry = self.entry(name)
        budget = self.budget
        while True:
            state = entry.lifecycle.state
            if state is State.READY:
                # The common case (room for one more request) needs no await.
                if budget.try_admit(name) or await budget.admit(name):
                    return self._lease(entry)
                continue  # it left memory while we waited: load it again
            await self._loader.ensure_loading(entry)
            task = entry.task
            if task is not None:
                entry.waiting += 1
                try:
                    # Shield: a caller giving up (deadline) must not cancel the shared load.
                    await asyncio.shield(task)
                finally:
                    entry.waiting -= 1
                    if entry.waiting == 0:
                        budget.reconsider()  # no longer held for its waiters
            elif entry.unloading is not None:
                await asyncio.shield(entry.unloading)

    def leases_now(self, names: Sequence[str]) -> list[Lease] | None:
        """Leases of all of `names` at once; None where `acquire` would have to wait.

        All or none: a request that must wait for one of its models takes none
        of them here, so it is not counted as a hit twice.
        """
        entries = []
        for name in names:
            entry = self.entries.get(name)
            if entry is None or entry.lifecycle.state is not State.READY:
                break
            entries.append(entry)
        else:
            admitted: list[Entry] = []
            for entry in entries:
                if not self.budget.try_admit(entry.name):
                    for taken in admitted:
                        self.budget.release(taken.name)
                    return None
                admitted.append(entry)
            return [self._lease(entry) for entry in entries]
        return None

    def _lease(self, entry: Entry) -> Lease:
        entry.hits += 1
        entry.last_used_at = self._monotonic()
        entry.last_used_wall = self._wall()
        self._hit_counter(entry.name).inc()
        self.policy.on_hit(entry.candidate(), entry.last_used_at)
        return Lease(self, entry)

    def _release(self, entry: Entry) -> None:
        entry.last_used_at = self._monotonic()
        entry.last_used_wall = self._wall()
        self.budget.release(entry.name)

    def in_flight(self, name: str) -> int:
        """Requests of `name` holding a lease now."""
        return self.budget.admitted(name)

    # ---- loading (runtime/models/loading.py) -----------------------------------

    async def ensure_loading(self, entry: Entry) -> None:
        """Start the single-flight load of `entry` unless it is loading or loaded."""
        await self._loader.ensure_loading(entry)

    async def wait_built(self, name: str) -> Any:
        """The model object of `name` once built (INITIALIZED or later), loading it if needed."""
        return await self._loader.wait_built(name)

    # ---- eviction (the budget's Evictor) ----------------------------------------

    def _evictable(self, exclude: str) -> list[Entry]:
        budget = self.budget
        return [
            e
            for e in self.entries.values()
            if e.name != exclude
            and e.lifecycle.state is State.READY
            and budget.reservation(e.name) is not None
            and budget.admitted(e.name) == 0
            and e.waiting == 0
            and not e.pinned
        ]

    def evict_for(self, need_bytes: int, exclude: str) -> bool:
        budget = self.budget
        assert budget.limit is not None
        idle = self._evictable(exclude)
        freeable = sum(e.weights_bytes + e.per_request_bytes for e in idle)
        if budget.reserved_bytes() + need_bytes - freeable > budget.limit:
            # Evicting every idle bundle would still not make room: evict none
            # (each would only have to be loaded again) and wait for releases.
            return False
        now = self._monotonic()
        by_name = {e.name: e for e in idle}
        evicted = False
        for candidate in self.policy.order([e.candidate() for e in idle], now):
            if budget.reserved_bytes() + need_bytes <= budget.limit:
                break
            self._unload_now(by_name[candidate.name], reason="evicted")
            self.policy.on_evict(candidate, now)
            evicted = True
        return evicted

    def unevictable_bytes(self, exclude: str) -> int:
        return sum(
            e.weights_bytes + e.per_request_bytes
            for e in self.entries.values()
            if e.pinned and e.name != exclude and self.budget.reservation(e.name) is not None
        )

    def busy(self) -> bool:
        # Bundles holding memory now that will free it or become evictable: a load
        # past its wait for room, a loaded bundle its waiters are about to take, an
        # unload under way.
        return any(
            (e.task is not None or e.waiting or e.unloading is not None)
            and self.budget.reservation(e.name) is not None
            for e in self.entries.values()
        )

    def _unload_now(self, entry: Entry, *, reason: str) -> None:
        """READY and idle -> UNLOADED, synchronously (the caller holds no await)."""
        entry.lifecycle.advance(State.UNLOADING)
        self.budget.close(entry.name)
        with host.bundle_window(returning=True):  # its memory given back: see host.py
            self._forget(entry)
            entry.lifecycle.advance(State.UNLOADED)
            device = self.device
            if device is not None:
                weights_mod.release(device)
        if reason == "evicted":
            self.metrics.cache_events.labels(entry.name, "eviction").inc()
        log.info("%s %s", reason, entry.name)

    def _forget(self, entry: Entry) -> None:
        entry.model = None
        entry.built.clear()
        self.budget.unreserve(entry.name)
        if entry.manifest is not None:
            self.source.release(entry.manifest)  # its files may go from the node cache now

    async def unload(self, name: str) -> None:
        """Drain `name` (in-flight requests finish), then free its memory.

        A load under way is abandoned (its waiters get `load-failed`), so an
        unload answers at once whatever a builder does.
        """
        entry = self.entry(name)
        if entry.task is not None:
            await self._loader.abandon(entry, "unloaded while loading")
        if entry.unloading is not None:
            await asyncio.shield(entry.unloading)
            return
        if entry.lifecycle.state is not State.READY:
            return
        entry.unloading = asyncio.get_running_loop().create_future()
        try:
            entry.lifecycle.advance(State.UNLOADING)
            self.budget.close(name)
            await self.budget.idle(name)
            with host.bundle_window(returning=True):  # its memory given back: see host.py
                self._forget(entry)
                entry.lifecycle.advance(State.UNLOADED)
                device = self.device
                if device is not None:
                    await asyncio.to_thread(weights_mod.release, device)
            log.info("unloaded %s", name)
        finally:
            done, entry.unloading = entry.unloading, None
            done.set_result(None)

    async def unload_all(self) -> None:
        await asyncio.gather(*(self.unload(n) for n in list(self.entries)), return_exceptions=True)

    # ---- views --------------------------------------------------------------

    def describe(self, entry: Entry) -> dict[str, Any]:
        view = entry.view()
        view["in_flight"] = self.in_flight(entry.name)
        view["waiting_for_memory"] = self.budget.waiting(entry.name)
        batching = {
            h.name: h.batch.describe() for h in self.registry.users_of(entry.name) if h.batch
        }
        if batching:  # the handlers of this bundle that batch, and their policy
            view["batching"] = batching
        if entry.manifest is not None:
            view["estimate"] = self.estimator.describe(entry.manifest)
            view["memory"] = self.memory_plan(entry)
        return view

    def memory_plan(self, entry: Entry) -> dict[str, Any]:
        assert entry.manifest is not None
        budget = self.budget
        plan: dict[str, Any] = {
            "weights_bytes": entry.weights_bytes,
            "per_request_bytes": entry.per_request_bytes,
            "budget_bytes": budget.limit,
        }
        if entry.manifest.kv_bytes_per_token:
            plan["kv_bytes_per_token"] = entry.manifest.kv_bytes_per_token
        if budget.limit is not None and entry.per_request_bytes > 0:
            plan["admitted_concurrency"] = budget.admitted_concurrency(
                entry.name, entry.weights_bytes, entry.per_request_bytes
            )
        else:
            plan["admitted_concurrency"] = None  # bounded by the queue, not memory
        return plan
