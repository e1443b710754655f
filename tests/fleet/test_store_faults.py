"""A fleet instance whose PostgreSQL is wrong or unreachable at start: /healthz
answers, /readyz is 503 naming the reason, job routes answer 503
storage-unavailable with Retry-After, nothing crashes; once the database
answers, the same process is ready and serves jobs, by itself."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.jobs import postgres_fixtures
from tests.support import ServerProcess, until

postgres_cluster = postgres_fixtures.postgres_cluster

STORAGE_UNAVAILABLE = "https://thaw.dev/problems/storage-unavailable"


@pytest.fixture
def instance(thaw_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[[str], ServerProcess]]:
    started: list[ServerProcess] = []

    def start(dsn: str) -> ServerProcess:
        server = ServerProcess(
            {**thaw_env, "THAW_JOB_STORE": dsn, "THAW_HANDLERS": "handlers.echo"}
        )
        server.log_path = tmp_path / f"server-{server.port}.log"
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.kill()


@pytest.fixture
def unstarted_cluster() -> Iterator[postgres_fixtures.PostgresCluster]:
    """A cluster on a port of its own that nothing listens on until the test starts it."""
    bindir = postgres_fixtures.server_bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (apt-get install postgresql; .ci/run does)")
    cluster = postgres_fixtures.PostgresCluster(bindir)
    yield cluster
    cluster.remove()


def assert_unavailable(client: httpx.Client, reason: str) -> None:
    assert client.get("/healthz").status_code == 200
    ready = client.get("/readyz")
    assert ready.status_code == 503
    [condition] = ready.json()["conditions"]
    assert condition["condition"] == "job-store"
    assert reason in condition["detail"]
    for response in (
        client.post("/handlers/echo/jobs", json={"x": 1}),
        client.post("/invoke/echo", json={"x": 1}, headers={"Prefer": "respond-async"}),
        client.get("/jobs/0123456789abcdef"),
        client.delete("/jobs/0123456789abcdef"),
    ):
        assert response.status_code == 503, response.text
        assert response.headers["content-type"] == "application/problem+json"
        assert response.json()["type"] == STORAGE_UNAVAILABLE
        assert reason in response.json()["detail"]
        assert int(response.headers["retry-after"]) > 0


def assert_serves_jobs(client: httpx.Client) -> None:
    job_id = client.post("/handlers/echo/jobs", json={"x": 2}).raise_for_status().json()["id"]
    body = client.get(f"/jobs/{job_id}?wait=30").raise_for_status().json()
    assert (body["status"], body["output"]) == ("succeeded", {"x": 2})


def test_unreachable_at_start_then_ready_by_itself(
    instance: Callable[[str], ServerProcess], unstarted_cluster: postgres_fixtures.PostgresCluster
) -> None:
    server = instance(unstarted_cluster.dsn())
    with server.client() as client:
        until(lambda: client.get("/readyz").json().get("conditions"), "the job-store condition")
        assert_unavailable(client, "Connection refused")
        # A call that needs no store still runs.
        assert client.post("/invoke/echo", json={"y": 1}).json() == {"y": 1}
        unstarted_cluster.start()
        until(lambda: client.get("/readyz").status_code == 200, "readiness once it answers")
        assert_serves_jobs(client)
    assert server.proc is not None and server.proc.poll() is None
    assert "Traceback" not in server.log()


def test_a_database_that_does_not_exist(
    instance: Callable[[str], ServerProcess], postgres_cluster: postgres_fixtures.PostgresCluster
) -> None:
    server = instance(postgres_cluster.dsn("no_such_database"))
    with server.client() as client:
        until(lambda: client.get("/readyz").json().get("conditions"), "the job-store condition")
        assert_unavailable(client, 'database "no_such_database" does not exist')
        postgres_cluster.execute("CREATE DATABASE no_such_database")
        try:
            until(lambda: client.get("/readyz").status_code == 200, "readiness once it exists")
            assert_serves_jobs(client)
        finally:
            server.kill()
            postgres_cluster.drop_database("no_such_database")
    assert "Traceback" not in server.log()


def test_postgresql_restarted_under_a_fleet(
    thaw_env: dict[str, str], tmp_path: Path, unstarted_cluster: postgres_fixtures.PostgresCluster
) -> None:
    """While PostgreSQL is down the fleet answers 503 storage-unavailable through
    nginx; once it is back every instance recovers by itself, and the jobs accepted
    before the restart are all there."""
    from tests.fleet.harness import Fleet, nginx_binary

    binary = nginx_binary()
    if binary is None:
        pytest.skip("no nginx binary (apt-get install nginx; .ci/run does)")
    cluster = unstarted_cluster
    cluster.start()
    dsn = cluster.dsn(cluster.create_database())
    env = {**thaw_env, "THAW_HANDLERS": "handlers.echo"}
    fleet = Fleet(binary, env, dsn, tmp_path / "fleet", 2)
    try:
        with fleet.client() as client:
            before = [
                client.post("/handlers/echo/jobs", json={"n": n}).raise_for_status().json()["id"]
                for n in range(4)
            ]
            for job_id in before:
                assert client.get(f"/jobs/{job_id}?wait=30").json()["status"] == "succeeded"
            cluster.stop("immediate")  # as abrupt as a crash
            refused = client.post("/handlers/echo/jobs", json={"n": 9})
            assert refused.status_code == 503
            assert refused.json()["type"] == STORAGE_UNAVAILABLE
            assert int(refused.headers["retry-after"]) > 0
            for server in fleet.instances:
                with server.client() as direct:
                    until(lambda d=direct: d.get("/readyz").status_code == 503, "unready")  # type: ignore[misc]
                    assert direct.get("/healthz").status_code == 200
            cluster.start()
            for server in fleet.instances:
                with server.client() as direct:
                    until(lambda d=direct: d.get("/readyz").status_code == 200, "ready again")  # type: ignore[misc]
            for n, job_id in enumerate(before):
                body = client.get(f"/jobs/{job_id}").raise_for_status().json()
                assert (body["status"], body["output"]) == ("succeeded", {"n": n})
            assert_serves_jobs(client)
    finally:
        fleet.stop()
