"""Per-handler invocation counts and run-time histograms, as Prometheus scrapes them."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from runtime.telemetry.metrics import Metrics


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


def test_client_errors_are_counted_apart_from_handler_errors() -> None:
    metrics = Metrics()
    stats = metrics.handler("echo")
    stats.count("client_error")
    stats.count("error")
    stats.count("error")
    samples = _samples(metrics)

    def total(outcome: str) -> float:
        return samples[("thaw_invocations_total", (("handler", "echo"), ("outcome", outcome)))]

    assert total("client_error") == 1
    assert total("error") == 2


def test_queue_waits_are_a_histogram_per_handler() -> None:
    metrics = Metrics()
    stats = metrics.handler("echo")
    for seconds in (0.0, 0.02, 3.0):
        stats.observe_queue(seconds)
    samples = _samples(metrics)
    labels = (("handler", "echo"),)
    assert samples[("thaw_queue_wait_seconds_count", labels)] == 3
    assert abs(samples[("thaw_queue_wait_seconds_sum", labels)] - 3.02) < 1e-9
    assert samples[("thaw_queue_wait_seconds_bucket", (("handler", "echo"), ("le", "0.025")))] == 2


def test_request_durations_by_method_route_and_status() -> None:
    metrics = Metrics()
    metrics.requests.observe("POST", "/invoke/{handler}", 200, 0.004)
    metrics.requests.observe("POST", "/invoke/{handler}", 200, 0.2)
    metrics.requests.observe("POST", "/invoke/{handler}", 400, 0.001)
    # Any other method a client makes up is one label value, so the series stay few.
    metrics.requests.observe("BREW", "(unmatched)", 405, 0.001)
    metrics.requests.observe("SPILL", "(unmatched)", 405, 0.001)
    samples = _samples(metrics)
    ok = (("method", "POST"), ("route", "/invoke/{handler}"), ("status", "200"))
    assert samples[("thaw_http_request_duration_seconds_count", ok)] == 2
    assert abs(samples[("thaw_http_request_duration_seconds_sum", ok)] - 0.204) < 1e-9
    le = tuple(sorted((*ok, ("le", "0.005"))))
    assert samples[("thaw_http_request_duration_seconds_bucket", le)] == 1
    other = (("method", "other"), ("route", "(unmatched)"), ("status", "405"))
    assert samples[("thaw_http_request_duration_seconds_count", other)] == 2


def test_the_estimate_error_keeps_a_sum_and_count_in_each_direction() -> None:
    metrics = Metrics()
    error = metrics.estimate_error_seconds.labels("minilm")
    for seconds in (2.0, 0.5, -1.5):
        error.observe(seconds)
    samples = _samples(metrics)
    late = (("bundle", "minilm"), ("direction", "optimistic"))
    early = (("bundle", "minilm"), ("direction", "pessimistic"))
    assert samples[("thaw_estimate_error_seconds_sum", late)] == 2.5
    assert samples[("thaw_estimate_error_seconds_count", late)] == 2
    assert samples[("thaw_estimate_error_seconds_sum", early)] == 1.5
    assert samples[("thaw_estimate_error_seconds_count", early)] == 1
    # Magnitudes in non-negative buckets, so `_sum` is exposed and only grows.
    assert all(
        float(dict(labels)["le"]) >= 0
        for (name, labels) in samples
        if name == "thaw_estimate_error_seconds_bucket"
    )


def test_the_process_collector_is_registered() -> None:
    samples = _samples(Metrics())
    assert samples[("process_resident_memory_bytes", ())] > 0
    assert ("process_cpu_seconds_total", ()) in samples
