"""Prometheus metrics, one registry per runtime instance (tests run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LOAD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


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
        self.invocations = Counter(
            "thaw_invocations",
            "Invocations by outcome: sync (200), async (202), error, throttled (429).",
            ["handler", "outcome"],
            registry=self.registry,
        )
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
        self.run_seconds = Histogram(
            "thaw_run_seconds",
            "Handler run seconds.",
            ["handler"],
            registry=self.registry,
        )
        self.resident_bytes = Gauge(
            "thaw_memory_reserved_bytes",
            "Bytes reserved in the memory budget (weights plus admitted requests).",
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
