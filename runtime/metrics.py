"""Prometheus metrics, one registry per runtime instance (tests run several)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

_LOAD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_RUN_BUCKETS = Histogram.DEFAULT_BUCKETS  # ends with +Inf
_RUN_LE = [floatToGoString(b) for b in _RUN_BUCKETS]  # type: ignore[no-untyped-call]
OUTCOMES = ("sync", "async", "error", "throttled")


class HandlerStats:
    """One handler's invocations by outcome and its run-time histogram, as plain numbers.

    Every request updates these on the event loop; prometheus_client's Counter
    and Histogram would take a lock per update, four per request. They are
    read at scrape time (`_HandlerCollector`), also on the loop.
    """

    __slots__ = ("outcomes", "run_counts", "run_sum")

    def __init__(self) -> None:
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.run_counts = [0] * len(_RUN_BUCKETS)
        self.run_sum = 0.0

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] += 1

    def observe_run(self, seconds: float) -> None:
        self.run_sum += seconds
        # The first bucket whose bound is >= seconds (the last bound is +Inf).
        self.run_counts[bisect_left(_RUN_BUCKETS, seconds)] += 1


class _HandlerCollector(Collector):
    def __init__(self, stats: dict[str, HandlerStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        invocations = CounterMetricFamily(
            "thaw_invocations",
            "Invocations by outcome: sync (200), async (202), error, throttled (429).",
            labels=["handler", "outcome"],
        )
        run = HistogramMetricFamily("thaw_run_seconds", "Handler run seconds.", labels=["handler"])
        for name, stats in list(self._stats.items()):
            for outcome, n in stats.outcomes.items():
                invocations.add_metric([name, outcome], n)
            cumulative = list(accumulate(stats.run_counts))
            run.add_metric([name], list(zip(_RUN_LE, cumulative, strict=True)), stats.run_sum)
        yield invocations
        yield run


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
        self.registry.register(_HandlerCollector(self.handlers))
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
        self.jobs = Counter(
            "thaw_jobs",
            "Jobs reaching each status in this instance.",
            ["status"],
            registry=self.registry,
        )
        self.estimate_error_seconds = Histogram(
            "thaw_estimate_error_seconds",
            "Actual minus estimated load seconds (positive: the estimate was optimistic).",
            ["bundle"],
            buckets=(-30, -10, -3, -1, -0.3, -0.1, 0, 0.1, 0.3, 1, 3, 10, 30),
            registry=self.registry,
        )
        self.resident_bytes = Gauge(
            "thaw_memory_reserved_bytes",
            "Bytes reserved in the memory budget (weights plus admitted requests).",
            registry=self.registry,
        )

    def handler(self, name: str) -> HandlerStats:
        found = self.handlers.get(name)
        if found is None:
            found = self.handlers[name] = HandlerStats()
        return found

    def render(self) -> bytes:
        return generate_latest(self.registry)
