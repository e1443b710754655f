"""The single-flight load pipeline: fetch -> load weights -> build -> warm-up -> READY.

A load is an asyncio task on the bundle's `Entry`; every concurrent caller
awaits that same task, so a bundle version loads once however many requests
arrive (single flight), while different bundles load in parallel (no global
lock). Blocking steps (hashing, reading tensors, building, warm-up) run in
worker threads.

The device is resolved (importing torch) once per instance, overlapping the
first fetch; it also fixes the memory budget when none was configured. Memory
for the weights is reserved in the budget (runtime/models/budget.py, which
evicts if needed) before they are read. A failed or cancelled load releases
everything, goes to FAILED and may be tried again after an exponential
back-off.

No progress, no end: each phase fails with `load-failed`, naming the phase,
once it has made no progress for `PhaseLimits.stall_s` (runtime/models/phases.py).
Waiting requests and jobs get that error at once. An unload during a load
abandons the load the same way, so `DELETE /models/{name}` answers at once
whatever a builder does.

The loader owns the entries' load state and changes it on the event loop
thread only; the cache hands it what it needs in its constructor.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from functools import partial
from typing import Any, Protocol

from runtime.bundles.sources.source import BundleSource, fetch_for_load
from runtime.clock import Clock
from runtime.context import Context
from runtime.errors import LoadFailed, ThawError
from runtime.models import weights as weights_mod
from runtime.models.budget import MemoryBudget
from runtime.models.entry import Entry
from runtime.models.estimate import Estimator
from runtime.models.eviction import EvictionPolicy
from runtime.models.lifecycle import LOAD_PHASES, State
from runtime.models.phases import PhaseLimits, PhaseWatch
from runtime.models.weights import host
from runtime.registry import HandlerSpec, Registry
from runtime.telemetry.health import Health
from runtime.telemetry.metrics import Metrics
from runtime.wire.render import job_error, user_traceback

log = logging.getLogger("thaw.cache")


class WarmUp(Protocol):
    """Runs one warm-up example of a handler with its models, as a request of it runs.

    Given to the cache by the composition root (runtime/instance.py); how a
    handler runs (threads, torch modes, a batch of one) is the dispatch
    layer's (`Executor.warm_up`), and what the handler raised arrives as
    Thaw's error.
    """

    def __call__(
        self, spec: HandlerSpec, example: dict[str, Any], models: list[Any], ctx: Context
    ) -> Awaitable[Any]: ...


# The back-off after failed loads doubles per failure up to 64x THAW_RETRY_BACKOFF_S
# (64 s by default), so a bundle that failed often is still retried within minutes.
MAX_BACKOFF_DOUBLINGS = 6


class Loader:
    """Loads bundles, one task per entry."""

    def __init__(
        self,
        *,
        source: BundleSource,
        registry: Registry,
        estimator: Estimator,
        metrics: Metrics,
        budget: MemoryBudget,
        policy: EvictionPolicy,
        warm_up: WarmUp,
        entry_of: Callable[[str], Entry],
        requested_device: str,
        retry_backoff_s: float,
        limits: PhaseLimits,
        health: Health,
        clock: Clock,
    ) -> None:
        self.source = source
        self.registry = registry
        self.estimator = estimator
        self.metrics = metrics
        self.budget = budget
        self.policy = policy
        self.warm_up = warm_up
        self.entry_of = entry_of
        self.requested_device = requested_device
        self.retry_backoff_s = retry_backoff_s
        self.health = health
        self.clock = clock
        self.phases = PhaseWatch(limits, health, clock)
        self.device: str | None = None
        self._device_task: asyncio.Future[str] | None = None
        # Bundles whose load `abandon` ended (an unload): not a failure to back off from.
        self._abandoned: set[str] = set()

    async def ensure_loading(self, entry: Entry) -> None:
        """Start the single-flight load of `entry` unless it is loading or loaded."""
        state = entry.lifecycle.state
        if entry.task is not None or state in (State.READY, State.UNLOADING):
            return
        if state is State.FAILED:
            wait_s = entry.retry_at - self.clock.monotonic()
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
        entry.abort = asyncio.get_running_loop().create_future()
        entry.task = asyncio.get_running_loop().create_task(self._load(entry))

    async def wait_built(self, name: str) -> Any:
        """The model object of `name` once built (INITIALIZED or later), loading it if needed."""
        entry = self.entry_of(name)
        if entry.model is None:
            await self.ensure_loading(entry)
            task = entry.task
            waiter = asyncio.ensure_future(entry.built.wait())
            watched: set[asyncio.Future[Any]] = {waiter} if task is None else {waiter, task}
            await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if entry.model is None:
                raise LoadFailed(f"bundle {name!r} failed to load")
        return entry.model

    async def abandon(self, entry: Entry, reason: str) -> None:
        """Fail the load under way now (its waiters get `load-failed`); returns once
        its task has cleaned up. A deliberate end (an unload), not a failure of the
        bundle: no back-off follows it."""
        task = entry.task
        if task is None:
            return
        self._abandoned.add(entry.name)
        if entry.abort is not None and not entry.abort.done():
            entry.abort.set_exception(LoadFailed(f"bundle {entry.name!r}: {reason}"))
        await asyncio.wait({task})

    def estimate_ready_s(self, entry: Entry, manifest: Any) -> float:
        """Seconds until `entry` is READY (0 when it is)."""
        if entry.lifecycle.state is State.READY:
            return 0.0
        in_state_s = self.clock.monotonic() - entry.lifecycle.entered_at
        state = entry.lifecycle.state if entry.task is not None else State.STORED
        remaining = self.estimator.remaining_s(manifest, state, in_state_s)
        if self.device is None and state in (State.STORED, State.FETCHED):
            # This process has not imported torch yet: the first load pays for it.
            remaining += self.estimator.framework_s()
        return remaining

    def _resolve_budget(self, device: str) -> int:
        free = weights_mod.device_memory_free(device)
        if free is not None:
            return int(free * 0.9)
        return int(weights_mod.host_memory_limit() * 0.8)

    async def _device_ready(self) -> str:
        """Resolve the device (importing torch) once per instance, shared by all loads."""
        if self._device_task is None:
            estimator = self.estimator
            requested = self.requested_device
            monotonic = self.clock.monotonic

            def resolve() -> str:
                started = monotonic()
                device = weights_mod.resolve_device(requested)
                estimator.record_framework(monotonic() - started)
                return device

            self._device_task = asyncio.ensure_future(asyncio.to_thread(resolve))
        device = await asyncio.shield(self._device_task)
        if self.device is None:
            self.device = device
            if self.budget.limit is None:
                self.budget.set_limit(self._resolve_budget(device))
        return device

    # ---- the load ---------------------------------------------------------------

    async def _load(self, entry: Entry) -> None:
        lc = entry.lifecycle
        lc.restart_clock()
        loaded: weights_mod.Loaded | None = None
        available: dict[str, Any] = {}
        started = self.clock.monotonic()
        # Waits a reload would not repeat (the framework import) or that are not
        # the bundle's own (memory held by others); left out of its reload cost.
        waited_s = 0.0
        builder_raised = False  # the failure is the builder's own exception (user code)
        # From the fetch to the end of the warm-up, or of the failure's release: the
        # memory this bundle keeps is made in it (host.bundle_window).
        window = ExitStack()
        try:
            window.enter_context(host.bundle_window())
            manifest = await self.phases.in_thread(entry, "fetch", self.source.manifest, entry.name)
            entry.manifest = manifest
            entry.estimated_load_s = self.estimator.remaining_s(manifest, State.STORED, 0.0)
            # Importing torch overlaps with fetching and verifying files.
            device_task = asyncio.ensure_future(self._device_ready())
            device_task.add_done_callback(lambda t: t.cancelled() or t.exception())
            self.metrics.cache_events.labels(entry.name, "miss").inc()
            entry.progress_bytes = 0
            monotonic = self.clock.monotonic

            def progress(n: int) -> None:
                # Called from the fetch's threads; the loop only reads these (for
                # /models and the stall check), so a lost update costs nothing.
                entry.progress_bytes += n
                entry.progress_at = monotonic()

            # With the shards' stamps, taken as it returns: the files the hashes vouched
            # for (or the load's will: `fetched.pending`). A shard rewritten or replaced
            # before the load opens it is refused.
            fetched = await self.phases.in_thread(
                entry, "fetch", fetch_for_load, self.source, manifest, progress
            )
            bundle_dir = fetched.directory
            lc.advance(State.FETCHED)
            entry.progress_bytes = 0  # from here, the weights' bytes read into memory
            waited_from = self.clock.monotonic()
            # The framework import is the process's, not this bundle's: not its stall.
            device = await self.phases.watch(entry, "load", device_task, stall=False)
            # Waiting for others' memory is not this load stalling: no stall bound.
            await self.phases.watch(
                entry,
                "load",
                self.budget.reserve(entry.name, manifest.weights_bytes, manifest.per_request_bytes),
                stall=False,
            )
            waited_s = self.clock.monotonic() - waited_from
            # The shards the fetch left unhashed are checked as they are read.
            load = partial(weights_mod.open_weights, on_progress=progress, pending=fetched.pending)
            loaded = await self.phases.in_thread(
                entry, "load", load, bundle_dir, manifest, device, fetched.stamps
            )
            lc.advance(State.LOADED)
            builder = self.registry.builder(entry.name)
            assert builder is not None  # the cache checked it before making the entry
            files = {f.path: bundle_dir / f.path for f in manifest.files}
            available.update(
                {
                    "weights": loaded.take(),
                    "config": manifest.config,
                    "device": device,
                    "files": files,
                    "manifest": manifest,
                }
            )

            def build(loaded: weights_mod.Loaded) -> Any:
                model = builder.call(available)
                # The model keeps what it keeps; the load's own references go first,
                # so that detaching copies out of mapped files only what the model views.
                available.clear()
                loaded.detach()
                return model

            try:
                entry.model = await self.phases.in_thread(entry, "init", build, loaded)
            except ThawError:
                raise
            except Exception as exc:
                # The builder's frames hold the weights; the traceback would keep
                # them alive for as long as anyone holds the error (and forever
                # when a frame of this load was frozen with the framework).
                traceback.clear_frames(exc.__traceback__)
                builder_raised = True
                raise LoadFailed(
                    f"builder for {entry.name!r} raised {type(exc).__name__}: {exc}", phase="init"
                ) from exc
            entry.weights_read = loaded.how
            if loaded.how == "mapped":
                log.info(
                    "%s: weights mapped from a read-only filesystem, %.1f MiB copied out",
                    manifest.short_id,
                    loaded.copied_out / 2**20,
                )
            loaded = None
            lc.advance(State.INITIALIZED)
            entry.built.set()
            await self._warm(entry)
            window.close()
            lc.advance(State.WARMED)
            lc.advance(State.READY)
            self._loaded(entry, manifest, started, waited_s)
        except BaseException as exc:
            # Cancellation is not an Exception: clean up on anything, in a window
            # that gives what the load made back (host.py).
            window.enter_context(host.bundle_window(returning=True))
            if loaded is not None:
                loaded.close()
                loaded = None
            available.clear()
            entry.model = None
            entry.built.clear()
            self.budget.unreserve(entry.name)
            if entry.manifest is not None:
                self.source.release(entry.manifest)
                if self.device is not None:
                    await asyncio.to_thread(weights_mod.release, self.device)
            error = job_error(exc)
            if isinstance(exc, ThawError) and "phase" in exc.extra:
                error["phase"] = exc.extra["phase"]
            if lc.state is not State.FAILED:
                lc.advance(State.FAILED, error=error)
            if entry.name in self._abandoned:
                # Unloaded on purpose: the next load may begin at once.
                self._abandoned.discard(entry.name)
                entry.retry_at = 0.0
                log.info("load of %s ended: %s", entry.name, error["message"])
            else:
                entry.failures += 1
                doublings = min(entry.failures - 1, MAX_BACKOFF_DOUBLINGS)
                entry.retry_at = self.clock.monotonic() + self.retry_backoff_s * 2**doublings
                # A builder's exception is logged once, here, at ERROR with its traceback.
                trace = user_traceback(exc, message=False) if builder_raised else ""
                log.log(
                    logging.ERROR if trace else logging.WARNING,
                    "load of %s failed: %s",
                    entry.name,
                    error["message"],
                    extra={"bundle": entry.name, "traceback": trace or None},
                )
            raise
        finally:
            window.close()
            entry.task = None
            entry.abort = None
            # A stall that left user code running wedges the instance, after this end.
            self.phases.load_ended(entry)
            # A READY bundle is evictable now, a failed one holds nothing: either
            # may be what the head of the memory queue waits for.
            self.budget.reconsider()

    def _loaded(self, entry: Entry, manifest: Any, started: float, waited_s: float) -> None:
        lc = entry.lifecycle
        entry.loads += 1
        entry.failures = 0
        now = self.clock.monotonic()
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

    async def _warm(self, entry: Entry) -> None:
        """Run the warm-up examples of every handler that uses this bundle (with the
        accelerator ones on an accelerator), before any of them is served."""
        assert self.device is not None  # resolved before the weights were read
        for spec in self.registry.users_of(entry.name):
            examples = spec.warmup_for(self.device)
            if not examples:
                continue
            models = [
                entry.model if name == entry.name else await self.wait_built(name)
                for name in spec.uses
            ]
            for index, example in enumerate(examples):
                ctx = Context(
                    request_id=f"warmup-{spec.name}-{index}",
                    handler=spec.name,
                    warmup=True,
                    clock=self.clock,
                )
                try:
                    await self.phases.watch(
                        entry, "warmup", self.warm_up(spec, dict(example), models, ctx)
                    )
                except LoadFailed:
                    raise
                except ThawError as exc:
                    # The model never became READY: the load failed, in its warm-up
                    # (docs/handlers.md), as a warm-up that hangs does.
                    raise LoadFailed(
                        f"warm-up {index} of handler {spec.name!r} failed: {exc.message}",
                        phase="warmup",
                    ) from exc
