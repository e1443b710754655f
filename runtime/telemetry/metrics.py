"""Prometheus metrics, one registry per runtime instance (tests run several).

What every request updates is kept as plain numbers (`HandlerStats`,
`RequestStats`, `Buckets`) and turned into metric families at scrape time:
prometheus_client's Counter and Histogram take a lock per update, and the
warm path would pay several per request. Updates and scrapes both run on the
event loop, so nothing here needs a lock.

    thaw_invocations_total{handler,outcome}        sync (200), async (202), client_error (4xx:
                                                   the caller's request was refused), error
                                                   (5xx: the handler or the runtime failed),
                                                   throttled (429)
    thaw_run_seconds{handler}                      the handler's own run time
    thaw_queue_wait_seconds{handler}               admission to the start of its run, load
                                                   time excluded (Server-Timing's `queue`)
    thaw_http_request_duration_seconds{method,route,status}
                                                   first byte in to last byte out, per route
                                                   template (never the raw path)
    thaw_estimate_error_seconds{bundle,direction}  |actual - estimated| load seconds
    thaw_batch_size{handler}                       requests per call of a batched handler
    thaw_batch_wait_seconds{handler}               a request's wait for its batch to start
                                                   (Server-Timing's `batch`)
    thaw_memory_reserved_bytes                     bytes reserved in the memory budget
    thaw_memory_budget_bytes                       the budget itself (NaN until the device
                                                   is known; beside process_resident_memory_bytes)
    thaw_fleet_jobs_queued{handler}                the fleet's queued jobs, read from a
                                                   shared store (PostgreSQL) at scrape time
    thaw_fleet_oldest_queued_age_seconds{handler}  how long its oldest queued job has waited
    process_*                                      the process collector (CPU, memory, fds)
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from itertools import accumulate

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

_LOAD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_RUN_BUCKETS = Histogram.DEFAULT_BUCKETS  # ends with +Inf
_RUN_LE = [floatToGoString(b) for b in _RUN_BUCKETS]  # type: ignore[no-untyped-call]
# From a warm no-op (about a millisecond) to a long-poll's 60 s and past it.
REQUEST_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    math.inf,
)
# Magnitudes: a histogram with negative buckets may not expose `_sum` (OpenMetrics),
# as a sum of signed values is no counter; the sign is the `direction` label.
_ESTIMATE_BUCKETS = (0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 60.0, 120.0, 300.0, math.inf)
# Batched handlers: requests per call, and each request's wait for its batch.
BATCH_SIZE_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, math.inf)
BATCH_WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, math.inf)
OUTCOMES = ("sync", "async", "client_error", "error", "throttled")
# The route label of a request no route matched (404), or refused before routing (401).
UNMATCHED = "(unmatched)"
# Methods labelled as they are; any other (a client may send any token) is "other",
# so a client cannot grow the label set.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE"})


def _le(bounds: Sequence[float]) -> list[str]:
    return [floatToGoString(b) for b in bounds]  # type: ignore[no-untyped-call]


class Buckets:
    """One histogram series as plain numbers: a count per bucket and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.sum += value
        # The first bucket whose bound is >= value (the last bound is +Inf).
        self.counts[bisect_left(self.bounds, value)] += 1

    def cumulative(self, le: Sequence[str]) -> list[tuple[str, float]]:
        return list(zip(le, accumulate(self.counts), strict=True))


class HandlerStats:
    """One handler's invocations by outcome, run-time and queue-wait histograms."""

    __slots__ = ("outcomes", "queue_counts", "queue_sum", "run_counts", "run_sum")

    def __init__(self) -> None:
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.run_counts = [0] * len(_RUN_BUCKETS)
        self.run_sum = 0.0
        self.queue_counts = [0] * len(_RUN_BUCKETS)
        self.queue_sum = 0.0

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] += 1

    def observe_run(self, seconds: float) -> None:
        self.run_sum += seconds
        # The first bucket whose bound is >= seconds (the last bound is +Inf).
        self.run_counts[bisect_left(_RUN_BUCKETS, seconds)] += 1

    def observe_queue(self, seconds: float) -> None:
        self.queue_sum += seconds
        self.queue_counts[bisect_left(_RUN_BUCKETS, seconds)] += 1


class BatchStats:
    """One batched handler's batch sizes and its requests' waits for their batch."""

    __slots__ = ("size", "wait")

    def __init__(self) -> None:
        self.size = Buckets(BATCH_SIZE_BUCKETS)
        self.wait = Buckets(BATCH_WAIT_BUCKETS)

    def observe_size(self, size: int) -> None:
        self.size.observe(float(size))

    def observe_wait(self, seconds: float) -> None:
        self.wait.observe(seconds)


class _BatchCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        size = HistogramMetricFamily(
            "thaw_batch_size", "Requests per call of a batched handler.", labels=["handler"]
        )
        wait = HistogramMetricFamily(
            "thaw_batch_wait_seconds",
            "Seconds a request of a batched handler waited for its batch to start.",
            labels=["handler"],
        )
        size_le, wait_le = _le(BATCH_SIZE_BUCKETS), _le(BATCH_WAIT_BUCKETS)
        for name, stats in sorted(self._metrics.batches.items()):
            size.add_metric([name], stats.size.cumulative(size_le), stats.size.sum)
            wait.add_metric([name], stats.wait.cumulative(wait_le), stats.wait.sum)
        yield size
        yield wait


class RequestStats:
    """End-to-end request durations by (method, route template, status)."""

    __slots__ = ("series",)

    def __init__(self) -> None:
        self.series: dict[tuple[str, str, int], Buckets] = {}

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        key = (method if method in METHODS else "other", route, status)
        found = self.series.get(key)
        if found is None:
            found = self.series[key] = Buckets(REQUEST_BUCKETS)
        # Buckets.observe, inline: this runs for every request.
        found.sum += seconds
        found.counts[bisect_left(REQUEST_BUCKETS, seconds)] += 1


class EstimateError:
    """Actual minus estimated load seconds, per bundle: `labels(bundle).observe(error)`.

    Kept as two magnitude histograms (direction `optimistic`: the load took
    longer than estimated; `pessimistic`: shorter), so each has a `_sum` and a
    `_count` that only grow. The mean signed error is
    (sum{optimistic} - sum{pessimistic}) / (count{optimistic} + count{pessimistic}).
    """

    def __init__(self) -> None:
        self.series: dict[tuple[str, str], Buckets] = {}

    def labels(self, bundle: str) -> _SignedError:
        return _SignedError(self, bundle)

    def _observe(self, bundle: str, error_s: float) -> None:
        key = (bundle, "optimistic" if error_s > 0 else "pessimistic")
        found = self.series.get(key)
        if found is None:
            found = self.series[key] = Buckets(_ESTIMATE_BUCKETS)
        found.observe(abs(error_s))


class _SignedError:
    __slots__ = ("_bundle", "_owner")

    def __init__(self, owner: EstimateError, bundle: str) -> None:
        self._owner = owner
        self._bundle = bundle

    def observe(self, error_s: float) -> None:
        self._owner._observe(self._bundle, error_s)


class FleetQueue:
    """The fleet's queue per handler as the shared store last told it (the jobs layer
    reads it at scrape time, runtime/jobs/fleet_queue.py). Every instance of a fleet
    exports the same figures: an autoscaler takes their max across instances.

    `figures` is None for a store no other instance shares (nothing is exported);
    `handlers` are this instance's, exported with 0 when none of theirs is queued,
    so an autoscaler sees a zero rather than no series.
    """

    def __init__(self) -> None:
        self.figures: dict[str, tuple[int, float]] | None = None
        self.handlers: tuple[str, ...] = ()
        # The wall-clock time the figures were read, for the oldest job's age.
        self.read_at = 0.0

    def update(self, figures: dict[str, tuple[int, float]], read_at: float) -> None:
        """`figures`: per handler, (queued jobs, the oldest one's created_at)."""
        self.figures = figures
        self.read_at = read_at


class _FleetCollector(Collector):
    def __init__(self, fleet: FleetQueue) -> None:
        self._fleet = fleet

    def collect(self) -> Iterator[Metric]:
        fleet = self._fleet
        if fleet.figures is None:
            return
        queued = GaugeMetricFamily(
            "thaw_fleet_jobs_queued",
            "Jobs queued in the fleet's shared store, per handler (every instance tells the same).",
            labels=["handler"],
        )
        oldest = GaugeMetricFamily(
            "thaw_fleet_oldest_queued_age_seconds",
            "Seconds the fleet's oldest queued job of each handler has waited (0: none queued).",
            labels=["handler"],
        )
        for name in sorted(set(fleet.handlers) | set(fleet.figures)):
            count, created_at = fleet.figures.get(name, (0, fleet.read_at))
            queued.add_metric([name], count)
            oldest.add_metric([name], max(0.0, fleet.read_at - created_at) if count else 0.0)
        yield queued
        yield oldest


class _Collector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        metrics = self._metrics
        invocations = CounterMetricFamily(
            "thaw_invocations",
            "Invocations by outcome: sync (200), async (202), client_error (4xx), "
            "error (5xx), throttled (429).",
            labels=["handler", "outcome"],
        )
        run = HistogramMetricFamily("thaw_run_seconds", "Handler run seconds.", labels=["handler"])
        queue = HistogramMetricFamily(
            "thaw_queue_wait_seconds",
            "Seconds from admission to the start of the handler's run, load time excluded.",
            labels=["handler"],
        )
        for name, stats in list(metrics.handlers.items()):
            for outcome, n in stats.outcomes.items():
                invocations.add_metric([name, outcome], n)
            cumulative = list(accumulate(stats.run_counts))
            run.add_metric([name], list(zip(_RUN_LE, cumulative, strict=True)), stats.run_sum)
            waited = list(accumulate(stats.queue_counts))
            queue.add_metric([name], list(zip(_RUN_LE, waited, strict=True)), stats.queue_sum)
        yield invocations
        yield run
        yield queue
        requests = HistogramMetricFamily(
            "thaw_http_request_duration_seconds",
            "HTTP requests from their first byte in to their last byte out, by route template.",
            labels=["method", "route", "status"],
        )
        request_le = _le(REQUEST_BUCKETS)
        for (method, route, status), buckets in sorted(metrics.requests.series.items()):
            requests.add_metric(
                [method, route, str(status)], buckets.cumulative(request_le), buckets.sum
            )
        yield requests
        error = HistogramMetricFamily(
            "thaw_estimate_error_seconds",
            "Magnitude of actual minus estimated load seconds; direction optimistic: the "
            "load took longer than estimated, pessimistic: shorter.",
            labels=["bundle", "direction"],
        )
        error_le = _le(_ESTIMATE_BUCKETS)
        for (bundle, direction), buckets in sorted(metrics.estimate_error_seconds.series.items()):
            error.add_metric([bundle, direction], buckets.cumulative(error_le), buckets.sum)
        yield error


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.load_phase_seconds = Histogram(
            "thaw_load_phase_seconds",
            "Seconds spent in each load phase, per bundle.",
            ["bundle", "phase"],
            buckets=_LOAD_BUCKETS,
            registry=self.registry,
        )
        self.handlers: dict[str, HandlerStats] = {}
        self.requests = RequestStats()
        self.estimate_error_seconds = EstimateError()
        self.registry.register(_Collector(self))
        self.batches: dict[str, BatchStats] = {}
        self.registry.register(_BatchCollector(self))
        self.cache_events = Counter(
            "thaw_cache_events",
            "Model cache hits, misses (a load was needed) and evictions.",
            ["bundle", "event"],
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "thaw_queue_depth",
            "Requests admitted and not finished, per handler.",
            ["handler"],
            registry=self.registry,
        )
        self.decode_sequences = Gauge(
            "thaw_decode_sequences",
            "Sequences of a step-level handler: running (their KV caches held, as of the "
            "last decode step) and waiting for a slot.",
            ["handler", "state"],
            registry=self.registry,
        )
        self.jobs = Counter(
            "thaw_jobs",
            "Jobs reaching each status in this instance.",
            ["status"],
            registry=self.registry,
        )
        self.resident_bytes = Gauge(
            "thaw_memory_reserved_bytes",
            "Bytes reserved in the memory budget (weights plus admitted requests).",
            registry=self.registry,
        )
        self.budget_bytes = Gauge(
            "thaw_memory_budget_bytes",
            "The memory budget in bytes (THAW_MEMORY_BUDGET, or what the device has); "
            "NaN until the device is known.",
            registry=self.registry,
        )
        self.fleet = FleetQueue()
        self.registry.register(_FleetCollector(self.fleet))
        # CPU seconds, resident and virtual memory, open fds, start time: read
        # from /proc at scrape time (absent where there is no /proc).
        ProcessCollector(registry=self.registry)

    def handler(self, name: str) -> HandlerStats:
        found = self.handlers.get(name)
        if found is None:
            found = self.handlers[name] = HandlerStats()
        return found

    def batch(self, handler: str) -> BatchStats:
        found = self.batches.get(handler)
        if found is None:
            found = self.batches[handler] = BatchStats()
        return found

    def render(self) -> bytes:
        return generate_latest(self.registry)
