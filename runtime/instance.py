"""The composition root: one runtime instance's components, wired together.

Every entry point (HTTP app, Lambda loop, `thaw invoke`) builds one
`Instance` from the settings, starts it, and stops it; nothing else
constructs the cache, the job store or the dispatcher.

Creating an instance does no I/O beyond handler discovery: the job store is
opened by `prepare()`, which `start()` runs at once and a server runs in a
worker thread once it listens, so that /healthz does not wait for it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from runtime.bundles.sources import open_source
from runtime.clock import SYSTEM, Clock
from runtime.dispatch.calls import Caller
from runtime.dispatch.dispatcher import Dispatcher
from runtime.jobs.manager import JobManager, JobRunner
from runtime.jobs.store import DeferredStore
from runtime.models.cache import ModelCache
from runtime.models.estimate import Estimator
from runtime.models.eviction import DensityPolicy
from runtime.models.lifecycle import State
from runtime.models.loading import PhaseLimits
from runtime.registry import Registry, discover
from runtime.settings import Settings
from runtime.telemetry.health import Health
from runtime.telemetry.metrics import Metrics

log = logging.getLogger("thaw.instance")

# Blocking work (hashing, tensor reads, store calls) runs in threads, and sync
# handlers in threads of their own (runtime/dispatch/calls.py); the default pool
# (cpu + 4) is too small for 64 waiting requests.
_THREADS = 64


@dataclass
class Instance:
    settings: Settings
    registry: Registry
    metrics: Metrics
    estimator: Estimator
    cache: ModelCache
    store: DeferredStore
    jobs: JobManager
    dispatcher: Dispatcher
    caller: Caller
    health: Health
    id: str
    # The one clock every component reads (runtime/clock.py).
    clock: Clock = SYSTEM
    # Ends the process once a drain is done: set by the entry point (the server
    # stops uvicorn, the Lambda loop stops taking events); None keeps it running.
    exit_hook: Callable[[], object] | None = None
    _background: set[asyncio.Task[None]] = field(default_factory=set)
    _drain: asyncio.Task[None] | None = None

    @classmethod
    def create(
        cls,
        settings: Settings,
        registry: Registry | None = None,
        *,
        clock: Clock = SYSTEM,
    ) -> Instance:
        """`clock` is the instance's one clock, handed to every component that reads
        time (leases, deadlines, back-offs, timers): tests pass a `ManualClock` and
        step past a back-off or a lease instead of sleeping through it."""
        registry = registry if registry is not None else discover(settings.handlers)
        metrics = Metrics()
        health = Health(clock)
        caller = Caller(_THREADS)
        estimator = Estimator(
            settings.state_path,
            default_bandwidth_bytes_s=settings.default_bandwidth_bytes_s,
            default_init_s=settings.default_init_s,
        )
        cache = ModelCache(
            source=open_source(settings, clock=clock),
            registry=registry,
            estimator=estimator,
            metrics=metrics,
            runner=caller.run,
            device=settings.device,
            memory_budget=settings.memory_budget,
            retry_backoff_s=settings.retry_backoff_s,
            policy=DensityPolicy(min_residency_s=settings.min_residency_s),
            pinned=settings.prewarm,
            limits=PhaseLimits(stall_s=settings.phase_stall_s),
            health=health,
            clock=clock,
        )
        store = DeferredStore(settings.job_store, ttl_s=settings.job_ttl_s, clock=clock)
        instance_id = f"{socket.gethostname()}-{secrets.token_hex(4)}"

        def jobs(runner: JobRunner) -> JobManager:
            return JobManager(
                store,
                owner=instance_id,
                lease_s=settings.job_lease_s,
                max_attempts=settings.job_max_attempts,
                metrics=metrics,
                health=health,
                owners_dir=settings.state_path / "owners",
                runner=runner,
                clock=clock,
            )

        dispatcher = Dispatcher(
            settings=settings,
            registry=registry,
            cache=cache,
            jobs=jobs,
            estimator=estimator,
            metrics=metrics,
            caller=caller,
            health=health,
        )
        instance = cls(
            settings,
            registry,
            metrics,
            estimator,
            cache,
            store,
            dispatcher.jobs,
            dispatcher,
            caller,
            health,
            instance_id,
            clock,
        )
        health.on_wedged = lambda condition: instance.begin_drain(condition.detail)
        return instance

    async def start(self, *, background: bool = True) -> None:
        """Start the instance; with `background`, prepare it and begin prewarm and
        recovery at once (a failure to open the job store raises here).

        A server passes background=False and calls `start_background()` once it
        listens: prewarm imports torch, whose first import holds the GIL for a
        few hundred ms, and must not delay the control interface; nor need
        opening the job store.
        """
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(_THREADS, "thaw"))
        if background:
            await asyncio.to_thread(self.prepare)
            self.start_background()

    def prepare(self) -> None:
        """Take this instance's owner lock and open the job store (blocking; idempotent).

        Nothing has to wait for it: a store call arriving first opens the
        store itself, or waits for the open in progress.
        """
        self.jobs.hold_owner_lock()
        self.store.open()

    def start_background(self, on_error: Callable[[Exception], None] | None = None) -> None:
        """Begin prewarm at once, and job recovery once `prepare()` ran in a worker
        thread; if that fails, `on_error` gets the exception (a server exits)."""
        for name in self.settings.prewarm:
            self.spawn(self.prewarm(name))
        self.spawn(self._prepare_then_maintain(on_error))

    async def _prepare_then_maintain(self, on_error: Callable[[Exception], None] | None) -> None:
        try:
            await asyncio.to_thread(self.prepare)
        except Exception as exc:
            log.critical("start-up failed: %s: %s", type(exc).__name__, exc)
            if on_error is not None:
                on_error(exc)
            return
        await self._maintain()

    async def _maintain(self) -> None:
        """Take the jobs of dead instances of this node, recover lapsed jobs and purge
        expired ones: now (the start-up reclaim) and every lease period.

        Polls recover a lapsed job at once; this loop makes sure one nobody
        polls is still retried (or failed) instead of staying `running`.
        """
        while True:
            await self.jobs.maintain()
            await self.clock.sleep(max(1.0, self.settings.job_lease_s))

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def prewarm(self, name: str) -> None:
        try:
            lease = await self.cache.acquire(name)
        except Exception as exc:
            log.warning("prewarm of %s failed: %s", name, exc)
            return
        lease.release()

    def abort(self) -> None:
        """The process is stopping now: cut off what is still in flight."""
        self.dispatcher.abort_in_flight()

    @property
    def wedged(self) -> bool:
        return self.health.wedged is not None

    async def wait_idle(self) -> None:
        """Returns once no invocation or job of this instance is running."""
        await self.dispatcher.wait_idle()

    @property
    def draining(self) -> bool:
        return self.dispatcher.draining

    def begin_drain(self, reason: str) -> bool:
        """Readiness off and no new work now; in-flight work gets the drain grace,
        then the rest is aborted and `exit_hook` ends the process. Idempotent:
        False when a drain had begun already."""
        if self._drain is not None:
            return False
        self.dispatcher.draining = True
        log.info("draining (%s): grace %.1f s", reason, self.settings.drain_grace_s)

        async def drain_then_exit() -> None:
            await self.dispatcher.drain(self.settings.drain_grace_s)
            if self.exit_hook is not None:
                self.exit_hook()

        self._drain = asyncio.get_running_loop().create_task(drain_then_exit())
        return True

    def ready(self) -> bool:
        """Prewarm set READY, healthy, and not draining."""
        if self.dispatcher.draining or not self.health.ok:
            return False
        return all(
            name in self.cache.entries and self.cache.entries[name].lifecycle.state is State.READY
            for name in self.settings.prewarm
        )

    async def stop(self) -> None:
        if self._drain is not None:
            await asyncio.shield(self._drain)
        else:
            await self.dispatcher.drain(self.settings.drain_grace_s)
        self.caller.shutdown()
        for task in list(self._background):
            task.cancel()
        self.store.close()
        self.jobs.close()
