"""deploy/kubernetes/: every manifest is valid against the Kubernetes schemas
(kubernetes-validate, strict: an unknown field fails) for the oldest and the
newest release it claims, KEDA's objects against deploy/kubernetes/keda.schema.json
(written from KEDA's documented fields: no offline validator ships KEDA's
schema), and the manifests agree with each other and with Thaw: the names they
refer to exist, the probes are Thaw's, the drain fits the grace period, the
Secret's store URL is one Thaw accepts, and KEDA's query runs on Thaw's schema.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from runtime.jobs.stores.postgres_pool import parse_url
from runtime.settings import Settings
from tests.jobs import postgres_fixtures

postgres_cluster = postgres_fixtures.postgres_cluster

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
# preStop's `sleep` action is beta (on by default) from 1.30.
KUBERNETES = ("1.30.0", "1.37.0")
KEDA_API = "keda.sh/v1alpha1"


def documents() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return docs


def one(kind: str) -> dict[str, Any]:
    [doc] = [d for d in documents() if d["kind"] == kind]
    return doc


def keda_schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((DEPLOY / "keda.schema.json").read_text())
    return schema


def container() -> dict[str, Any]:
    [found] = one("Deployment")["spec"]["template"]["spec"]["containers"]
    return dict(found)


def env_of(found: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in found["env"]}


def test_the_manifests_hold_every_kind_the_fleet_needs() -> None:
    kinds = sorted(d["kind"] for d in documents())
    assert kinds == ["Deployment", "ScaledObject", "Secret", "Service", "TriggerAuthentication"]


@pytest.mark.parametrize("version", KUBERNETES)
def test_kubernetes_objects_are_valid_for_their_schemas(version: str) -> None:
    checked = 0
    for doc in documents():
        if doc["apiVersion"] == KEDA_API:
            continue
        kubernetes_validate.validate(doc, version, strict=True)
        checked += 1
    assert checked == 3


def test_a_misspelt_field_fails_the_kubernetes_validator() -> None:
    broken = copy.deepcopy(one("Deployment"))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES[-1], strict=True)


def test_keda_objects_are_valid_for_keda_schema() -> None:
    schema = keda_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    keda = [d for d in documents() if d["apiVersion"] == KEDA_API]
    assert len(keda) == 2
    for doc in keda:
        jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)


@pytest.mark.parametrize(
    "spoil",
    [
        lambda so: so["spec"].update(minReplicaCounts=0),
        lambda so: so["spec"]["triggers"][0]["metadata"].pop("query"),
        lambda so: so["spec"]["triggers"][0]["metadata"].update(threshold=4),
        lambda so: so["spec"]["triggers"][1]["metadata"].update(targetQueryValu="4"),
        lambda so: so["spec"].pop("scaleTargetRef"),
    ],
    ids=["misspelt-field", "missing-query", "number-not-string", "misspelt-metadata", "no-target"],
)
def test_keda_schema_refuses_a_spoilt_scaled_object(spoil: Any) -> None:
    broken = copy.deepcopy(one("ScaledObject"))
    spoil(broken)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, keda_schema(), cls=jsonschema.Draft202012Validator)


def test_probes_are_thaws_readiness_and_liveness() -> None:
    found = container()
    ports = {p["name"]: p["containerPort"] for p in found["ports"]}
    assert found["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert found["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert found[probe]["httpGet"]["port"] in ports
    assert env_of(found)["PORT"]["value"] == str(ports["http"])


def test_the_drain_ends_within_the_termination_grace() -> None:
    pod = one("Deployment")["spec"]["template"]["spec"]
    found = container()
    pause = found["lifecycle"]["preStop"]["sleep"]["seconds"]
    settings = Settings.from_env({k: v["value"] for k, v in env_of(found).items() if "value" in v})
    assert pause > 0
    # The kubelet SIGKILLs at the grace period: the pause, then the whole drain.
    assert pause + settings.drain_grace_s < pod["terminationGracePeriodSeconds"]


def test_every_secret_reference_names_a_key_of_the_secret() -> None:
    secret = one("Secret")
    keys = set(secret["stringData"])
    pod = one("Deployment")["spec"]["template"]["spec"]
    refs = [
        item["valueFrom"]["secretKeyRef"]
        for item in container()["env"]
        if "secretKeyRef" in item.get("valueFrom", {})
    ]
    refs += [
        {"name": v["secret"]["secretName"], "key": i["key"]}
        for v in pod["volumes"]
        if "secret" in v
        for i in v["secret"]["items"]
    ]
    refs += [
        {"name": r["name"], "key": r["key"]}
        for r in one("TriggerAuthentication")["spec"]["secretTargetRef"]
    ]
    assert {"job-store", "api-keys", "keda-connection"} <= {r["key"] for r in refs}
    for ref in refs:
        assert ref["name"] == secret["metadata"]["name"]
        assert ref["key"] in keys
    assert env_of(container())["THAW_JOB_STORE"]["valueFrom"]["secretKeyRef"]["key"] == (
        "job-store"
    )


def test_the_store_url_goes_through_pgbouncer_and_listens_directly() -> None:
    target = parse_url(one("Secret")["stringData"]["job-store"])
    assert "port=6432" in target.conninfo and "host=pgbouncer" in target.conninfo
    assert "port=5432" in target.listen_conninfo and "host=postgres" in target.listen_conninfo


def test_service_and_scaler_point_at_the_deployment() -> None:
    deployment = one("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    service = one("Service")
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] in {p["name"] for p in container()["ports"]}
    scaled = one("ScaledObject")["spec"]
    assert scaled["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert scaled["scaleTargetRef"]["kind"] == "Deployment"
    assert scaled["minReplicaCount"] == 0  # scale to zero
    # KEDA owns the replica count: a count in the Deployment would fight it on apply.
    assert "replicas" not in deployment["spec"]
    [auth_ref] = [t["authenticationRef"] for t in scaled["triggers"] if "authenticationRef" in t]
    assert auth_ref["name"] == one("TriggerAuthentication")["metadata"]["name"]


@pytest.fixture
def store_database(postgres_cluster: postgres_fixtures.PostgresCluster) -> Iterator[str]:
    name = postgres_cluster.create_database()
    yield name
    postgres_cluster.drop_database(name)


def test_kedas_query_counts_the_queued_jobs_of_thaws_schema(
    postgres_cluster: postgres_fixtures.PostgresCluster, store_database: str
) -> None:
    import psycopg

    from runtime.jobs.job import Job, new_job_id
    from runtime.jobs.stores.postgres import PostgresJobStore

    store = PostgresJobStore(postgres_cluster.dsn(store_database), ttl_s=3600)
    try:
        for index in range(3):
            store.create(Job(id=new_job_id(), handler="echo", input={"n": index}))
        claimed = store.claim_next("someone", lease_s=30, max_attempts=3)
        assert claimed is not None
    finally:
        store.close()
    [trigger] = [t for t in one("ScaledObject")["spec"]["triggers"] if t["type"] == "postgresql"]
    with psycopg.connect(postgres_cluster.dsn(store_database)) as conn:
        row = conn.execute(trigger["metadata"]["query"].encode()).fetchone()
    assert row == (2,)


def test_the_prometheus_query_names_a_metric_thaw_exports() -> None:
    from runtime.telemetry.metrics import Metrics

    metrics = Metrics()
    metrics.fleet.update({"echo": (3, 0.0)}, read_at=10.0)
    exported = metrics.render().decode()
    [trigger] = [t for t in one("ScaledObject")["spec"]["triggers"] if t["type"] == "prometheus"]
    query = trigger["metadata"]["query"]
    assert "thaw_fleet_jobs_queued" in query
    assert 'thaw_fleet_jobs_queued{handler="echo"} 3.0' in exported
