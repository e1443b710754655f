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
import contextlib
import logging
import secrets
import socket
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from runtime.bundles.sources import open_source
from runtime.clock import SYSTEM, Clock
from runtime.dispatch.answers import WAIT, Answer, Policy
from runtime.dispatch.dispatcher import Dispatcher
from runtime.dispatch.executor import Executor
from runtime.dispatch.streams import Stream
from runtime.errors import Draining, ThawError, UnknownBundle
from runtime.jobs.fleet import Fleet
from runtime.jobs.fleet_queue import FleetQueueReader
from runtime.jobs.job import Job
from runtime.jobs.manager import JobManager, JobRunner
from runtime.jobs.quota import JobQuota, Limits
from runtime.jobs.store import DeferredStore
from runtime.models.cache import ModelCache
from runtime.models.estimate import Estimator
from runtime.models.eviction import DensityPolicy
from runtime.models.lifecycle import State
from runtime.models.phases import PhaseLimits
from runtime.registry import Registry, discover
from runtime.settings import Settings
from runtime.telemetry.health import Health
from runtime.telemetry.metrics import Metrics, RequestStats

log = logging.getLogger("thaw.instance")

# Blocking work (hashing, tensor reads, store calls) runs in threads, and sync
# handlers in threads of their own (runtime/dispatch/executor.py); the default pool
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
    executor: Executor
    health: Health
    id: str
    # The one clock every component reads (runtime/clock.py).
    clock: Clock = SYSTEM
    # Ends the process once a drain is done: set by the entry point (the server
    # stops uvicorn, the Lambda loop stops taking events); None keeps it running.
    exit_hook: Callable[[], object] | None = None
    # The fleet's queue figures for /metrics; wake-ups, liveness and queued work
    # shared with the other instances of a fleet (runtime/jobs/fleet.py).
    fleet_queue: FleetQueueReader | None = None
    fleet: Fleet | None = None
    _background: set[asyncio.Task[None]] = field(default_factory=set)
    _drain: asyncio.Task[None] | None = None
    # A store a fleet may share (PostgreSQL) that this instance has not joined yet:
    # not ready until it has, so that work it cannot start soon is the fleet's
    # (recorded queued) from its first request behind a load balancer.
    _joining: bool = False

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
        executor = Executor(
            settings.handler_threads, run_limit_s=settings.run_timeout_s, clock=clock
        )
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
            warm_up=executor.warm_up,
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
                quota=JobQuota(
                    Limits(
                        jobs_per_key=settings.max_jobs_per_key,
                        bytes_per_key=settings.max_job_bytes_per_key,
                        jobs=settings.max_jobs,
                        bytes=settings.max_job_bytes,
                    ),
                    ttl_s=settings.job_ttl_s,
                    clock=clock,
                ),
            )

        dispatcher = Dispatcher(
            settings=settings,
            registry=registry,
            cache=cache,
            jobs=jobs,
            estimator=estimator,
            metrics=metrics,
            executor=executor,
            health=health,
            clock=clock,
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
            executor,
            health,
            instance_id,
            clock,
        )
        instance._joining = settings.job_store.startswith(("postgresql://", "postgres://"))
        metrics.fleet.handlers = tuple(sorted(registry.handlers))
        instance.fleet_queue = FleetQueueReader(store, metrics.fleet, clock)
        instance.fleet = Fleet(dispatcher.jobs)
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
        Nothing waits for it: a store call arriving first opens the store itself,
        or waits for the open in progress."""
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
        if self.fleet is not None and self.fleet.start(self.store.open()):
            work = _FleetWork(self)
            self.spawn(self.fleet.judge(work))
            self.spawn(self.fleet.take_queued(work))
        self._joining = False
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
        """Prewarm set READY, healthy, not draining, and in its fleet (if it has one)."""
        if self.dispatcher.draining or not self.health.ok or self._joining:
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
        self.executor.shutdown()
        for task in list(self._background):
            task.cancel()
        if self.fleet is not None:
            self.fleet.close()
        self.store.close()
        self.jobs.close()

    # ---- what the entry points ask: HTTP routes, the Lambda loop, the CLI ----------
    # They talk to these, never to the parts above (the dispatcher, the cache, the
    # job manager, the metrics), so that the parts can change behind them.

    def invoke(
        self,
        handler: str,
        event: Any,
        *,
        wait_s: float | None = None,
        policy: Policy = WAIT,
        request_id: str,
        key_id: str | None = None,
    ) -> Coroutine[Any, Any, Answer]:
        """`handler` run on `event` under the deadline rule, answered as `policy` says
        (runtime/dispatch/answers.py): its output, its stream, or its job. Not a
        coroutine function: it hands back the dispatcher's own coroutine (no frame)."""
        return self.dispatcher.invoke(
            handler, event, wait_s=wait_s, policy=policy, request_id=request_id, key_id=key_id
        )

    def count_refused(self, handler: str, status: int) -> None:
        """Count a request to a known handler refused before it was admitted."""
        stats = self.metrics.handlers.get(handler)  # never a new label for an unknown name
        if stats is not None:
            stats.count("client_error" if status < 500 else "error")

    def serves(self, handler: str) -> bool:
        """Whether `handler` names a registered handler."""
        return handler in self.registry.handlers

    def handler_names(self) -> list[str]:
        return sorted(self.registry.handlers)

    def bundle_names(self) -> list[str]:
        return sorted(self.registry.bundle_names())

    async def job(self, job_id: str, *, key_id: str | None, wait_s: float = 0.0) -> Job:
        """The job as stored (NotFound for another key's); `wait_s` long-polls for its end."""
        return await self.jobs.get(job_id, key_id=key_id, wait_s=wait_s)

    async def job_view(
        self, job_id: str, *, key_id: str | None, wait_s: float = 0.0
    ) -> dict[str, Any]:
        """The job's public object; a stream this instance runs shows its items so far."""
        job = await self.jobs.get(job_id, key_id=key_id, wait_s=wait_s)
        body = job.public()
        stream = self.dispatcher.streams.get(job.id)
        if stream is not None and not job.status.final:
            # Held here: live, where the store has the last heartbeat's.
            body["progress"] = stream.partial()
        return body

    def job_stream(self, job_id: str) -> Stream | None:
        """The stream of a job this instance runs; None when it runs elsewhere or ended."""
        return self.dispatcher.streams.get(job_id)

    async def cancel_job(self, job_id: str, *, key_id: str | None) -> Job:
        """Cancel a job that has not finished; the job as it is then."""
        return await self.jobs.cancel(job_id, key_id=key_id)

    async def models_view(self, *, asked_only: bool = False) -> dict[str, Any]:
        """Every bundle known (`asked_only`: those asked for) and the memory budget."""
        cache = self.cache
        names = set(cache.entries) | (set() if asked_only else set(self.registry.bundle_names()))
        views = []
        for name in sorted(names):
            entry = cache.entry(name)
            if entry.manifest is None:
                with contextlib.suppress(ThawError):
                    await cache.manifest_of(name)
            views.append(cache.describe(entry))
        return {
            "models": views,
            "budget_bytes": cache.budget.limit,
            "reserved_bytes": cache.reserved_bytes(),
            "waiting_for_memory": cache.budget.waiting(),
        }

    def _bundle(self, name: str) -> str:
        if self.registry.builder(name) is None:
            raise UnknownBundle(f"no bundle named {name!r}")
        return name

    async def load_bundle(self, name: str) -> dict[str, Any]:
        """Begin loading bundle `name` in the background; its view once the load began."""
        self._bundle(name)
        if self.draining:
            raise Draining("this instance is draining")
        self.spawn(self.prewarm(name))
        await asyncio.sleep(0)
        return self.cache.describe(self.cache.entry(name))

    async def unload_bundle(self, name: str) -> dict[str, Any]:
        """Unload bundle `name` once its in-flight requests finish; its view then."""
        self._bundle(name)
        await self.cache.unload(name)
        return self.cache.describe(self.cache.entry(name))

    def readiness(self, *, details: bool = True) -> dict[str, Any]:
        """`{"status": "ready"}` when `ready()`; else why not (draining, unhealthy or
        warming) and the classes of the health conditions; with `details`, also the
        prewarm bundles not READY yet and each condition's detail and start."""
        if self.ready():
            return {"status": "ready"}
        if self.draining:
            status = "draining"
        elif not self.health.ok:
            status = "unhealthy"
        else:
            status = "warming"
        conditions = self.health.describe()
        if not details:
            # A detail may name a path or a job: the log and operators have it.
            return {
                "status": status,
                "conditions": [{"condition": c["condition"]} for c in conditions],
            }
        waiting = [n for n in self.settings.prewarm if not self.cache.is_ready(n)]
        return {"status": status, "waiting": waiting, "conditions": conditions}

    async def metrics_text(self) -> bytes:
        """Every metric in the Prometheus text format (the fleet's queue read if stale)."""
        if self.fleet_queue is not None:
            await self.fleet_queue.refresh()
        return self.metrics.render()

    @property
    def request_stats(self) -> RequestStats:
        """Where the HTTP edge records each request's duration."""
        return self.metrics.requests


class _FleetWork:
    """What the fleet's parts ask of this instance (runtime/jobs/fleet.py's `Work`)."""

    def __init__(self, instance: Instance) -> None:
        self.i = instance

    def idle(self) -> bool:
        return not self.i.draining and not self.i.dispatcher.in_flight and not self.i.jobs.local

    def draining(self) -> bool:
        return self.i.draining

    def handlers(self) -> list[str]:
        return self.i.handler_names()

    def warm(self, handler: str) -> bool:
        return all(self.i.cache.is_ready(b) for b in self.i.registry.handler(handler).uses)
