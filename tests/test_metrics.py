"""Per-handler invocation counts and run-time histograms, as Prometheus scrapes them."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from runtime.metrics import Metrics


def _samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_outcomes_are_counted_per_handler() -> None:
    metrics = Metrics()
    echo, other = metrics.handler("echo"), metrics.handler("other")
    for _ in range(3):
        echo.count("sync")
    echo.count("async")
    other.count("throttled")
    samples = _samples(metrics)

    def total(handler: str, outcome: str) -> float:
        key = ("thaw_invocations_total", (("handler", handler), ("outcome", outcome)))
        return samples[key]

    assert total("echo", "sync") == 3
    assert total("echo", "async") == 1
    assert total("echo", "error") == 0
    assert total("other", "throttled") == 1
    assert total("other", "sync") == 0


def test_run_seconds_fall_in_cumulative_buckets_bounds_inclusive() -> None:
    metrics = Metrics()
    stats = metrics.handler("echo")
    for seconds in (0.001, 0.005, 0.2, 30.0):
        stats.observe_run(seconds)
    samples = _samples(metrics)

    def bucket(le: str) -> float:
        return samples[("thaw_run_seconds_bucket", (("handler", "echo"), ("le", le)))]

    assert bucket("0.005") == 2, "a value equal to a bound falls in that bound's bucket"
    assert bucket("0.1") == 2
    assert bucket("0.25") == 3
    assert bucket("10.0") == 3
    assert bucket("+Inf") == 4
    assert samples[("thaw_run_seconds_count", (("handler", "echo"),))] == 4
    assert abs(samples[("thaw_run_seconds_sum", (("handler", "echo"),))] - 30.206) < 1e-9


def test_a_handler_seen_once_is_scraped_with_zeros() -> None:
    metrics = Metrics()
    metrics.handler("idle")
    samples = _samples(metrics)
    assert samples[("thaw_run_seconds_count", (("handler", "idle"),))] == 0
    key = ("thaw_invocations_total", (("handler", "idle"), ("outcome", "sync")))
    assert samples[key] == 0
