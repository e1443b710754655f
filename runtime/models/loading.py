"""The single-flight load pipeline: fetch -> load weights -> build -> warm-up -> READY.

A load is an asyncio task on the bundle's `Entry`; every concurrent caller
awaits that same task, so a bundle version loads once however many requests
arrive (single flight), while different bundles load in parallel (no global
lock). Blocking steps (hashing, reading tensors, building, warm-up) run in
worker threads.

The device is resolved (importing torch) once per instance, overlapping the
first fetch; it also fixes the memory budget when none was configured. Memory
for the weights is reserved in the cache's budget (evicting if needed) before
they are read. A failed or cancelled load releases everything, goes to FAILED
and may be tried again after an exponential back-off.

The `Loader` is a part of its `ModelCache`: it reads the cache's dependencies
and entries and changes them on the event loop thread only.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.context import Context
from runtime.errors import HandlerError, LoadFailed, ThawError
from runtime.models import weights as weights_mod
from runtime.models.entry import Entry
from runtime.models.lifecycle import LOAD_PHASES, State
from runtime.registry import HandlerSpec

if TYPE_CHECKING:
    from runtime.models.cache import ModelCache

log = logging.getLogger("thaw.cache")

# Runs a handler function with its models; the dispatcher owns how (threads, torch modes).
Runner = Callable[[HandlerSpec, dict[str, Any], list[Any], Context], Awaitable[Any]]


class Loader:
    """Loads bundles for one `ModelCache`, one task per entry."""

    def __init__(self, cache: ModelCache) -> None:
        self._cache = cache
        self._device_task: asyncio.Future[str] | None = None

    async def ensure_loading(self, entry: Entry) -> None:
        """Start the single-flight load of `entry` unless it is loading or loaded."""
        state = entry.lifecycle.state
        if entry.task is not None or state in (State.READY, State.DRAINING):
            return
        if state is State.FAILED:
            wait_s = entry.retry_at - self._cache.clock()
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
        entry = self._cache.entry(name)
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

    async def estimate_ready_s(self, entry: Entry) -> float:
        """Seconds until `entry` is READY (0 when it is)."""
        if entry.lifecycle.state is State.READY:
            return 0.0
        manifest = await self._cache.manifest_of(entry.name)
        in_state_s = time.monotonic() - entry.lifecycle.entered_at
        state = entry.lifecycle.state if entry.task is not None else State.STORED
        remaining = self._cache.estimator.remaining_s(manifest, state, in_state_s)
        if self._cache.device is None and state in (State.STORED, State.FETCHED):
            # This process has not imported torch yet: the first load pays for it.
            remaining += self._cache.estimator.framework_s()
        return remaining

    def _resolve_budget(self, device: str) -> int:
        if self._cache.configured_budget:
            return self._cache.configured_budget
        free = weights_mod.device_memory_free(device)
        if free is not None:
            return int(free * 0.9)
        return int(weights_mod.host_memory_limit() * 0.8)

    async def _device_ready(self) -> str:
        """Resolve the device (importing torch) once per instance, shared by all loads."""
        cache = self._cache
        if self._device_task is None:

            def resolve() -> str:
                started = time.monotonic()
                device = weights_mod.resolve_device(cache.requested_device)
                cache.estimator.record_framework(time.monotonic() - started)
                return device

            self._device_task = asyncio.ensure_future(asyncio.to_thread(resolve))
        device = await asyncio.shield(self._device_task)
        if cache.device is None:
            cache.device = device
            cache.budget = self._resolve_budget(device)
        return device

    async def _load(self, entry: Entry) -> None:
        cache = self._cache
        lc = entry.lifecycle
        lc.restart_clock()
        weights: dict[str, Any] | None = None
        available: dict[str, Any] = {}
        started = cache.clock()
        # Waits a reload would not repeat (the framework import) or that are not
        # the bundle's own (memory held by others); left out of its reload cost.
        waited_s = 0.0
        try:
            manifest = await asyncio.to_thread(cache.source.manifest, entry.name)
            entry.manifest = manifest
            entry.estimated_load_s = cache.estimator.remaining_s(manifest, State.STORED, 0.0)
            # Importing torch overlaps with fetching and verifying files.
            device_task = asyncio.ensure_future(self._device_ready())
            cache.metrics.cache_events.labels(entry.name, "miss").inc()
            entry.progress_bytes = 0

            def progress(n: int) -> None:
                entry.progress_bytes += n

            device_task.add_done_callback(lambda t: t.cancelled() or t.exception())
            bundle_dir: Path = await asyncio.to_thread(cache.source.fetch, manifest, progress)
            lc.advance(State.FETCHED)
            waited_from = cache.clock()
            device = await device_task
            await cache._make_room(entry)
            waited_s = cache.clock() - waited_from
            weights = await asyncio.to_thread(
                weights_mod.load_weights, bundle_dir, manifest, device
            )
            lc.advance(State.LOADED)
            builder = cache.registry.builder(entry.name)
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
            now = cache.clock()
            entry.last_load_s = now - started
            entry.reload_s = max(0.0, entry.last_load_s - waited_s)
            entry.last_used_at = now
            cache.policy.on_load(entry.candidate(), now)
            cache.estimator.record_load(manifest, lc.phase_ms, persist=False)
            # The file write goes to a thread: waiters wake when this task ends.
            asyncio.get_running_loop().run_in_executor(None, cache.estimator.persist)
            for phase in LOAD_PHASES:
                if phase in lc.phase_ms:
                    cache.metrics.load_phase_seconds.labels(entry.name, phase).observe(
                        lc.phase_ms[phase] / 1000
                    )
            if entry.estimated_load_s is not None:
                cache.metrics.estimate_error_seconds.labels(entry.name).observe(
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
            if entry.manifest is not None and cache.device is not None:
                await asyncio.to_thread(weights_mod.release, cache.device)
            error = (
                exc.to_job_error()
                if isinstance(exc, ThawError)
                else {"type": "internal", "message": f"{type(exc).__name__}: {exc}"}
            )
            if lc.state is not State.FAILED:
                lc.advance(State.FAILED, error=error)
            entry.failures += 1
            entry.retry_at = cache.clock() + cache.retry_backoff_s * 2 ** (entry.failures - 1)
            log.warning("load of %s failed: %s", entry.name, error["message"])
            raise
        finally:
            entry.task = None
            await cache._notify()

    async def _warm(self, entry: Entry) -> None:
        """Run every warm-up example of every handler that uses this bundle."""
        for spec in self._cache.registry.users_of(entry.name):
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
                    await self._cache.runner(spec, dict(example), models, ctx)
                except ThawError as exc:
                    raise HandlerError(
                        f"warm-up {index} of handler {spec.name!r} failed: {exc.message}"
                    ) from exc
