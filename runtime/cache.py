"""The model cache: lazy single-flight loads, the memory budget and eviction.

Each bundle name has one `Entry` for the life of the instance. A load is an
asyncio task on the entry; every concurrent caller awaits that same task, so a
bundle version loads once however many requests arrive (single flight), while
different bundles load in parallel (no global lock). Blocking steps (hashing,
reading tensors, building, warm-up) run in worker threads.

Memory: the budget counts each resident or loading bundle's weights plus its
per-request bytes for every admitted request (at least one). Loads make room
by evicting idle, unpinned bundles in the policy's order (runtime/eviction.py;
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
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime import weights as weights_mod
from runtime.bundles import Manifest
from runtime.context import Context
from runtime.errors import (
    HandlerError,
    InsufficientMemory,
    LoadFailed,
    ThawError,
    UnknownBundle,
)
from runtime.estimate import Estimator
from runtime.eviction import Candidate, DensityPolicy, EvictionPolicy
from runtime.lifecycle import LOAD_PHASES, Lifecycle, State
from runtime.metrics import Metrics
from runtime.registry import HandlerSpec, Registry
from runtime.sources import BundleSource

log = logging.getLogger("thaw.cache")

# Runs a handler function with its models; the dispatcher owns how (threads, torch modes).
Runner = Callable[[HandlerSpec, dict[str, Any], list[Any], Context], Awaitable[Any]]


@dataclass
class Entry:
    name: str
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    manifest: Manifest | None = None
    model: Any = None
    task: asyncio.Task[None] | None = None
    built: asyncio.Event = field(default_factory=asyncio.Event)
    inflight: int = 0
    # Requests waiting for this entry's load. Once it is READY they acquire it
    # as soon as they run; until then it counts as in use, or a load waiting
    # for room could evict it under them, and their reload evict that load's
    # bundle in turn, forever.
    waiting: int = 0
    reserved: bool = False
    pinned: bool = False
    loads: int = 0
    hits: int = 0
    failures: int = 0
    retry_at: float = 0.0
    last_used_at: float = 0.0  # monotonic
    last_used_wall: float | None = None
    last_load_s: float = 0.0
    # last_load_s minus waits a reload would not repeat: the eviction policy's cost.
    reload_s: float = 0.0
    progress_bytes: int = 0
    estimated_load_s: float | None = None

    @property
    def weights_bytes(self) -> int:
        return self.manifest.weights_bytes if self.manifest else 0

    @property
    def per_request_bytes(self) -> int:
        return self.manifest.per_request_bytes if self.manifest else 0

    def charge(self) -> int:
        if not self.reserved:
            return 0
        return self.weights_bytes + max(1, self.inflight) * self.per_request_bytes

    def candidate(self) -> Candidate:
        """This entry as the eviction policy sees it: what evicting it would free when idle."""
        return Candidate(
            name=self.name,
            size_bytes=self.weights_bytes + self.per_request_bytes,
            reload_s=self.reload_s,
            last_used_at=self.last_used_at,
            hits=self.hits,
        )


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
        self._device_task: asyncio.Future[str] | None = None
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
        if entry.manifest is None:
            entry.manifest = await asyncio.to_thread(self.source.manifest, name)
        return entry.manifest

    async def estimate_ready_s(self, name: str) -> float:
        """Seconds until `name` is READY (0 when it is)."""
        entry = self.entry(name)
        if entry.lifecycle.state is State.READY:
            return 0.0
        manifest = await self.manifest_of(name)
        in_state_s = time.monotonic() - entry.lifecycle.entered_at
        state = entry.lifecycle.state if entry.task is not None else State.STORED
        remaining = self.estimator.remaining_s(manifest, state, in_state_s)
        if self.device is None and state in (State.STORED, State.FETCHED):
            # This process has not imported torch yet: the first load pays for it.
            remaining += self.estimator.framework_s()
        return remaining

    # ---- acquire / release --------------------------------------------------

    async def acquire(self, name: str) -> Lease:
        """Wait until `name` is READY and a request slot fits the budget."""
        entry = self.entry(name)
        while True:
            state = entry.lifecycle.state
            if state is State.READY:
                # The common case (room for one more request) needs no await.
                if self._fits_now(entry) or await self._admit(entry):
                    entry.inflight += 1
                    entry.hits += 1
                    entry.last_used_at = self.clock()
                    entry.last_used_wall = time.time()
                    self._hit_counter(name).inc()
                    self.policy.on_hit(entry.candidate(), entry.last_used_at)
                    return Lease(self, entry)
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

    async def ensure_loading(self, entry: Entry) -> None:
        """Start the single-flight load of `entry` unless it is loading or loaded."""
        state = entry.lifecycle.state
        if entry.task is not None or state in (State.READY, State.DRAINING):
            return
        if state is State.FAILED:
            wait_s = entry.retry_at - self.clock()
            if wait_s > 0:
                cause = entry.lifecycle.error or {}
                raise LoadFailed(
                    f"bundle {entry.name!r} failed to load "
                    f"({cause.get('type', 'error')}: {cause.get('message', '')}); "
                    f"next attempt in {wait_s:.1f} s",
                    retry_after_s=wait_s,
                    cause=cause,
                )
            entry.lifecycle.advance(State.STORED)
        elif state is State.UNLOADED:
            entry.lifecycle.advance(State.STORED)
        entry.task = asyncio.get_running_loop().create_task(self._load(entry))

    async def wait_built(self, name: str) -> Any:
        """The model object of `name` once built (INITIALIZED or later), loading it if needed."""
        entry = self.entry(name)
        if entry.model is None:
            await self.ensure_loading(entry)
            task = entry.task
            waiter = asyncio.ensure_future(entry.built.wait())
            watched: set[asyncio.Future[Any]] = {waiter}
            if task is not None:
                watched.add(task)
            await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if entry.model is None:
                raise LoadFailed(f"bundle {name!r} failed to load")
        return entry.model

    # ---- loading ------------------------------------------------------------

    def _resolve_budget(self, device: str) -> int:
        if self.configured_budget:
            return self.configured_budget
        free = weights_mod.device_memory_free(device)
        if free is not None:
            return int(free * 0.9)
        return int(weights_mod.host_memory_limit() * 0.8)

    async def _device_ready(self) -> str:
        """Resolve the device (importing torch) once per instance, shared by all loads."""
        if self._device_task is None:

            def resolve() -> str:
                started = time.monotonic()
                device = weights_mod.resolve_device(self.requested_device)
                self.estimator.record_framework(time.monotonic() - started)
                return device

            self._device_task = asyncio.ensure_future(asyncio.to_thread(resolve))
        device = await asyncio.shield(self._device_task)
        if self.device is None:
            self.device = device
            self.budget = self._resolve_budget(device)
        return device

    async def _load(self, entry: Entry) -> None:
        lc = entry.lifecycle
        lc.restart_clock()
        weights: dict[str, Any] | None = None
        available: dict[str, Any] = {}
        started = self.clock()
        # Waits a reload would not repeat (the framework import) or that are not
        # the bundle's own (memory held by others); left out of its reload cost.
        waited_s = 0.0
        try:
            manifest = await asyncio.to_thread(self.source.manifest, entry.name)
            entry.manifest = manifest
            entry.estimated_load_s = self.estimator.remaining_s(manifest, State.STORED, 0.0)
            # Importing torch overlaps with fetching and verifying files.
            device_task = asyncio.ensure_future(self._device_ready())
            self.metrics.cache_events.labels(entry.name, "miss").inc()
            entry.progress_bytes = 0

            def progress(n: int) -> None:
                entry.progress_bytes += n

            device_task.add_done_callback(lambda t: t.cancelled() or t.exception())
            bundle_dir: Path = await asyncio.to_thread(self.source.fetch, manifest, progress)
            lc.advance(State.FETCHED)
            waited_from = self.clock()
            device = await device_task
            await self._make_room(entry)
            waited_s = self.clock() - waited_from
            weights = await asyncio.to_thread(
                weights_mod.load_weights, bundle_dir, manifest, device
            )
            lc.advance(State.LOADED)
            builder = self.registry.builder(entry.name)
            assert builder is not None  # entry() checked
            files = {f.path: bundle_dir / f.path for f in manifest.files}
            available.update(
                {
                    "weights": weights,
                    "config": manifest.config,
                    "device": device,
                    "files": files,
                    "manifest": manifest,
                }
            )
            try:
                entry.model = await asyncio.to_thread(builder.call, available)
            except ThawError:
                raise
            except Exception as exc:
                # The builder's frames hold the weights; the traceback would keep
                # them alive for as long as anyone holds the error (and forever
                # when a frame of this load was frozen with the framework).
                traceback.clear_frames(exc.__traceback__)
                raise HandlerError(
                    f"builder for {entry.name!r} raised {type(exc).__name__}: {exc}"
                ) from exc
            weights = None
            available.clear()
            lc.advance(State.INITIALIZED)
            entry.built.set()
            await self._warm(entry)
            lc.advance(State.WARMED)
            lc.advance(State.READY)
            entry.loads += 1
            entry.failures = 0
            now = self.clock()
            entry.last_load_s = now - started
            entry.reload_s = max(0.0, entry.last_load_s - waited_s)
            entry.last_used_at = now
            self.policy.on_load(entry.candidate(), now)
            self.estimator.record_load(manifest, lc.phase_ms, persist=False)
            # The file write goes to a thread: waiters wake when this task ends.
            asyncio.get_running_loop().run_in_executor(None, self.estimator.persist)
            for phase in LOAD_PHASES:
                if phase in lc.phase_ms:
                    self.metrics.load_phase_seconds.labels(entry.name, phase).observe(
                        lc.phase_ms[phase] / 1000
                    )
            if entry.estimated_load_s is not None:
                self.metrics.estimate_error_seconds.labels(entry.name).observe(
                    entry.last_load_s - entry.estimated_load_s
                )
            log.info(
                "loaded %s in %.1f ms (%s)",
                manifest.short_id,
                entry.last_load_s * 1000,
                ", ".join(f"{p} {lc.phase_ms.get(p, 0.0):.1f}" for p in LOAD_PHASES),
            )
        except BaseException as exc:
            # Cancellation is not an Exception: clean up on anything.
            weights = None
            available.clear()
            entry.model = None
            entry.built.clear()
            entry.reserved = False
            if entry.manifest is not None and self.device is not None:
                await asyncio.to_thread(weights_mod.release, self.device)
            error = (
                exc.to_job_error()
                if isinstance(exc, ThawError)
                else {"type": "internal", "message": f"{type(exc).__name__}: {exc}"}
            )
            if lc.state is not State.FAILED:
                lc.advance(State.FAILED, error=error)
            entry.failures += 1
            entry.retry_at = self.clock() + self.retry_backoff_s * 2 ** (entry.failures - 1)
            log.warning("load of %s failed: %s", entry.name, error["message"])
            raise
        finally:
            entry.task = None
            await self._notify()

    async def _warm(self, entry: Entry) -> None:
        """Run every warm-up example of every handler that uses this bundle."""
        for spec in self.registry.users_of(entry.name):
            if not spec.warmup:
                continue
            models = [
                entry.model if name == entry.name else await self.wait_built(name)
                for name in spec.uses
            ]
            for index, example in enumerate(spec.warmup):
                ctx = Context(
                    request_id=f"warmup-{spec.name}-{index}", handler=spec.name, warmup=True
                )
                try:
                    await self.runner(spec, dict(example), models, ctx)
                except ThawError as exc:
                    raise HandlerError(
                        f"warm-up {index} of handler {spec.name!r} failed: {exc.message}"
                    ) from exc

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
        lc = entry.lifecycle
        manifest = entry.manifest
        view: dict[str, Any] = {
            "name": entry.name,
            "id": manifest.id if manifest else None,
            "version": manifest.version if manifest else None,
            "state": str(lc.state),
            "bytes": manifest.total_bytes if manifest else None,
            "phase_ms": {k: round(v, 3) for k, v in lc.phase_ms.items()},
            "loads": entry.loads,
            "hits": entry.hits,
            "in_flight": entry.inflight,
            "pinned": entry.pinned,
            "last_used_at": entry.last_used_wall,
            "error": lc.error,
        }
        if lc.loading or (lc.state is State.STORED and entry.task is not None):
            view["progress"] = {
                "phase": str(lc.state),
                "bytes": entry.progress_bytes,
                "total_bytes": manifest.total_bytes if manifest else None,
            }
        if manifest is not None:
            view["estimate"] = self.estimator.describe(manifest)
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
