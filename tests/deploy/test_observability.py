"""The Grafana dashboard (deploy/grafana/) and the Prometheus rules (deploy/prometheus/)
against a real `thaw serve` and a real promtool.

Every metric a panel query or a rule names must be in a real /metrics answer:
a `thaw serve` on a PostgreSQL job store (the fleet's queue figures exist only
there), after a model load, a batched call, sync invocations and a job, so
every series has appeared. Every query must parse (`promtool check rules` on
the queries written as recording rules), the rules must pass `promtool check
rules`, and their unit tests (deploy/prometheus/thaw-rules.test.yaml) must pass
`promtool test rules`. Without promtool those checks skip, saying why;
Debian's `prometheus` package has it (.ci/run installs it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.jobs import postgres_fixtures
from tests.support import SAFETY_S, ServerProcess, make_bundle

postgres_cluster = postgres_fixtures.postgres_cluster
pytest.importorskip("psycopg", reason="the fleet's metrics need the postgres extra (psycopg)")

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "thaw.json"
PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"
RULES = ROOT / "deploy" / "prometheus" / "thaw-rules.yaml"
RULES_TEST = ROOT / "deploy" / "prometheus" / "thaw-rules.test.yaml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="no promtool on PATH (apt-get install -y prometheus; .ci/run does)",
)
# Grafana's variables, as a query is sent to Prometheus.
VARIABLES = {"$__rate_interval": "5m", "$job": ".*", "$instance": ".*"}
# What the issue asks the dashboard to show, by the metric that shows it.
REQUIRED = {
    "thaw_invocations_total",  # request rate by handler
    "thaw_run_seconds_bucket",  # latency by handler
    "thaw_cache_events_total",  # cold starts
    "thaw_load_phase_seconds_sum",  # their phase times
    "thaw_queue_depth",
    "thaw_queue_wait_seconds_bucket",
    "thaw_batch_size_bucket",
    "thaw_memory_reserved_bytes",
    "thaw_memory_budget_bytes",
    "process_resident_memory_bytes",
    "thaw_jobs_total",
    "thaw_fleet_jobs_queued",
    "thaw_fleet_oldest_queued_age_seconds",
}
_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
    "and", "or", "unless", "inf", "nan",
    # Aggregation operators: `sum by (x) (...)` puts the grouping between name and call.
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile", "limitk", "limit_ratio",
}  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: every identifier that is not a
    function, keyword, label name or label value, grouping label or duration."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings (label values, formats)
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range and subquery durations
    text = re.sub(
        r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", text
    )  # grouping labels
    names = set()
    for match in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?", text):
        name, call = match.group(1), match.group(2)
        if not call and name.lower() not in _KEYWORDS:
            names.add(name)
    return names


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, query) for every target of every panel."""
    board = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"])
        for panel in board["panels"]
        for target in panel.get("targets", [])
    ]


def rules() -> list[dict[str, Any]]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def substitute(expr: str) -> str:
    for variable, value in VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"a Grafana variable the test does not know: {expr}"
    return expr


@pytest.fixture(scope="module")
def served(
    postgres_cluster: postgres_fixtures.PostgresCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, str]]:
    """A running `thaw serve` and its /metrics answer, once every kind of work has run."""
    tmp = tmp_path_factory.mktemp("observability")
    make_bundle(tmp / "bundles", "tiny", config={"sleep_s": 0.01})
    database = postgres_cluster.create_database()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("THAW_", "AWS_LAMBDA"))},
        "THAW_HANDLERS": "tests.handlers.echo,tests.handlers.batched,tests.handlers.slow_builder",
        "THAW_BUNDLE_SOURCE": str(tmp / "bundles"),
        "THAW_CACHE_DIR": str(tmp / "cache"),
        "THAW_STATE_DIR": str(tmp / "state"),
        "THAW_JOB_STORE": postgres_cluster.dsn(database),
        "PYTHONUNBUFFERED": "1",
    }
    server = ServerProcess(env)
    try:
        server.start()
        with server.client(timeout=SAFETY_S) as client:
            wait = {"prefer": f"wait={SAFETY_S:g}"}
            for event in ({"a": 1}, {"a": 2}):
                assert client.post("/invoke/echo", json=event).status_code == 200
            predicted = client.post("/invoke/predict", json={"x": 2}, headers=wait)
            assert predicted.status_code == 200, predicted.text  # a cold start: a load
            batched = client.post("/invoke/batch_gated", json={"id": 1}, headers=wait)
            assert batched.status_code == 200, batched.text
            job = client.post("/handlers/echo/jobs", json={"a": 3})
            assert job.status_code == 202, job.text
            polled = client.get(job.headers["location"], params={"wait": SAFETY_S}).json()
            assert polled["status"] == "succeeded", polled
            text = client.get("/metrics").text
        yield server, text
    finally:
        server.terminate()
        postgres_cluster.drop_database(database)


@pytest.fixture(scope="module")
def exposed(served: tuple[ServerProcess, str]) -> set[str]:
    """The sample names of the real /metrics answer."""
    samples = [s for f in text_string_to_metric_families(served[1]) for s in f.samples]
    # The budget beside the reservation: known once the model's device is.
    [budget] = [s.value for s in samples if s.name == "thaw_memory_budget_bytes"]
    assert budget > 0
    return {sample.name for sample in samples}


def test_the_dashboard_shows_what_the_issue_asks_for() -> None:
    used = set().union(*(metric_names(q) for _, q in dashboard_queries()))
    assert REQUIRED - used == set()


def test_every_metric_a_panel_names_is_in_a_real_metrics_answer(exposed: set[str]) -> None:
    missing = {
        (title, name)
        for title, query in dashboard_queries()
        for name in metric_names(query)
        if name not in exposed
    }
    assert missing == set()


def test_every_metric_a_rule_names_is_exposed_or_recorded(exposed: set[str]) -> None:
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    named = set().union(*(metric_names(str(rule["expr"])) for rule in rules()))
    assert named - exposed - recorded == set()
    assert {rule["alert"] for rule in rules() if "alert" in rule} == {
        "ThawColdStartAboveEstimate",
        "ThawQueuedPastDeadline",
        "ThawRSSAboveBudget",
    }


def test_metric_names_are_read_out_of_promql() -> None:
    query = (
        'sum by (handler, le) (rate(thaw_run_seconds_bucket{job=~"a", outcome="sync"}[5m])) '
        "/ on (handler) group_left () thaw:x + process_resident_memory_bytes offset 5m > bool 1e3"
    )
    assert metric_names(query) == {
        "thaw_run_seconds_bucket",
        "thaw:x",
        "process_resident_memory_bytes",
    }


def test_the_provisioning_points_grafana_at_the_dashboard() -> None:
    provider = yaml.safe_load((PROVISIONING / "dashboards" / "thaw.yaml").read_text())
    [entry] = provider["providers"]
    assert entry["type"] == "file" and entry["options"]["path"].endswith("/thaw")
    board = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in board["templating"]["list"]}
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            for query in (t["expr"] for t in panel["targets"]):
                used = set(re.findall(r"\$(\w+)", query)) - {"__rate_interval"}
                assert used <= variables, (panel["title"], used)


def _promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=SAFETY_S, check=False
    )


@pytest.mark.process
@needs_promtool
def test_every_panel_query_parses(tmp_path: Path) -> None:
    queries = dashboard_queries()
    recorded = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{n}", "expr": substitute(query)}
                    for n, (_, query) in enumerate(queries)
                ],
            }
        ]
    }
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump(recorded))
    done = _promtool("check", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(queries)} rules found" in done.stdout


@pytest.mark.process
@needs_promtool
def test_promtool_refuses_a_query_that_does_not_parse(tmp_path: Path) -> None:
    # The check above can fail: a broken query is refused.
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [
        {"record": "x:y", "expr": "sum by (handler (rate(thaw_jobs_total[5m]))"}
    ]}]}))  # fmt: skip
    assert _promtool("check", "rules", str(path)).returncode != 0


@pytest.mark.process
@needs_promtool
def test_the_rules_pass_promtool_check_and_their_unit_tests() -> None:
    checked = _promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = _promtool("test", "rules", RULES_TEST.name, cwd=RULES_TEST.parent)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


PROMETHEUS = shutil.which("prometheus")


@pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="no prometheus on PATH (apt-get install -y prometheus; .ci/run does)",
)
def test_a_real_prometheus_scraping_thaw_answers_every_panel_and_evaluates_every_rule(
    served: tuple[ServerProcess, str], tmp_path: Path
) -> None:
    """Prometheus itself, scraping the served instance every second with the rules
    loaded: every panel's queries run, each panel gets data, every rule is healthy."""
    import httpx

    from tests.support import free_port, until

    server, _ = served
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(RULES)],
                "scrape_configs": [
                    {
                        "job_name": "thaw",
                        "static_configs": [{"targets": [f"127.0.0.1:{server.port}"]}],
                    }
                ],
            }
        )
    )
    log = tmp_path / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                str(PROMETHEUS),
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=SAFETY_S) as api:

            def query(expr: str) -> list[dict[str, Any]]:
                body = api.get("/api/v1/query", params={"query": expr}).json()
                assert body["status"] == "success", (expr, body)
                result: list[dict[str, Any]] = body["data"]["result"]
                return result

            def scraped() -> bool:
                if proc.poll() is not None:
                    raise AssertionError(log.read_text()[-3000:])
                try:
                    # Until its storage is open, Prometheus answers 503 in plain text.
                    if api.get("/-/ready").status_code != 200:
                        return False
                    samples = query('count_over_time(up{job="thaw"}[1m])')
                except httpx.TransportError:
                    return False
                return bool(samples) and float(samples[0]["value"][1]) >= 3

            until(scraped, "three scrapes of the served instance")
            empty = []
            board = json.loads(DASHBOARD.read_text())
            for panel in (p for p in board["panels"] if p["type"] != "row"):
                exprs = [t["expr"].replace("$__rate_interval", "1m") for t in panel["targets"]]
                if not any(query(substitute(e)) for e in exprs):
                    empty.append(panel["title"])
            assert empty == []

            def evaluated() -> list[dict[str, Any]] | None:
                groups = api.get("/api/v1/rules").json()["data"]["groups"]
                found = [rule for group in groups for rule in group["rules"]]
                # "unknown" until a rule's first evaluation.
                return found if found and all(r["health"] != "unknown" for r in found) else None

            rules_seen = until(evaluated, "every rule evaluated once")
            assert [(r["name"], r["health"]) for r in rules_seen if r["health"] != "ok"] == []
            assert len(rules_seen) == len(rules())
    finally:
        proc.terminate()
        try:
            proc.wait(SAFETY_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
