"""Three real `thaw serve` instances on one PostgreSQL database behind nginx:
requests spread over every instance, and a job accepted by any of them is
answered by every other, whichever one a poll reaches."""

from __future__ import annotations

from runtime.jobs.job import Job, new_job_id
from runtime.jobs.stores.postgres import PostgresJobStore
from tests.fleet.conftest import MakeFleet
from tests.support import ServerProcess


def test_nginx_spreads_calls_over_every_instance(make_fleet: MakeFleet) -> None:
    fleet = make_fleet(3)
    with fleet.client() as client:
        pids = {
            client.post("/invoke/sleepy", json={"s": 0}).raise_for_status().json()["pid"]
            for _ in range(9)
        }
    assert pids == {server.proc.pid for server in fleet.instances if server.proc is not None}


def test_a_job_accepted_by_one_instance_is_answered_by_every_other(make_fleet: MakeFleet) -> None:
    fleet = make_fleet(3)
    with fleet.client() as client:
        accepted = [
            client.post("/handlers/echo/jobs", json={"n": n}).raise_for_status().json()["id"]
            for n in range(6)
        ]
        # Each poll through nginx reaches the next instance round-robin; the wait
        # ends when the job is final, wherever it ran.
        final = {job_id: client.get(f"/jobs/{job_id}?wait=30").json() for job_id in accepted}
    assert [final[j]["status"] for j in accepted] == ["succeeded"] * 6
    assert [final[j]["output"] for j in accepted] == [{"n": n} for n in range(6)]
    for server in fleet.instances:
        with server.client() as direct:
            for n, job_id in enumerate(accepted):
                body = direct.get(f"/jobs/{job_id}").raise_for_status().json()
                assert (body["id"], body["status"], body["output"]) == (
                    job_id,
                    "succeeded",
                    {"n": n},
                )
    with fleet.client() as client:
        assert client.get("/jobs/no-such-job").status_code == 404


def metric_lines(text: str, name: str) -> dict[str, float]:
    """`{labels: value}` of metric `name` in a Prometheus text page."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line.rpartition(" ")
            found[labels[len(name) :]] = float(value)
    return found


def test_metrics_export_the_fleets_queue_per_handler(make_fleet: MakeFleet, fleet_dsn: str) -> None:
    fleet = make_fleet(2)
    # Jobs of a function no instance of this fleet serves stay queued: the store is
    # shared, and so is its queue.
    store = PostgresJobStore(fleet_dsn, ttl_s=3600)
    try:
        for n in range(2):
            store.create(Job(id=new_job_id(), handler="elsewhere", input={"n": n}))
    finally:
        store.close()
    for server in fleet.instances:
        with server.client() as direct:
            text = direct.get("/metrics").raise_for_status().text
        queued = metric_lines(text, "thaw_fleet_jobs_queued")
        assert queued['{handler="elsewhere"}'] == 2
        assert queued['{handler="echo"}'] == 0  # its own handlers, as zeros
        ages = metric_lines(text, "thaw_fleet_oldest_queued_age_seconds")
        assert ages['{handler="elsewhere"}'] >= 0
        assert ages['{handler="echo"}'] == 0


def test_an_instance_on_its_own_sqlite_file_exports_no_fleet_queue(
    thaw_env: dict[str, str],
) -> None:
    server = ServerProcess({**thaw_env, "THAW_HANDLERS": "handlers.echo"})
    with server, server.client() as client:
        client.post("/handlers/echo/jobs", json={}).raise_for_status()
        text = client.get("/metrics").raise_for_status().text
    assert "thaw_fleet_jobs_queued" not in text
    assert "thaw_jobs_total" in text


def test_idle_instances_take_the_fleets_queued_jobs(make_fleet: MakeFleet, fleet_dsn: str) -> None:
    fleet = make_fleet(2)
    # Queued straight in the store (no instance accepted them): the fleet's queue.
    store = PostgresJobStore(fleet_dsn, ttl_s=3600)
    jobs = [Job(id=new_job_id(), handler="sleepy", input={"s": 0}) for _ in range(6)]
    try:
        store.create_many(jobs)
    finally:
        store.close()
    with fleet.client() as client:
        final = [client.get(f"/jobs/{job.id}?wait=30").json() for job in jobs]
    assert [body["status"] for body in final] == ["succeeded"] * 6
    assert [body["attempts"] for body in final] == [1] * 6
    pids = {server.proc.pid for server in fleet.instances if server.proc is not None}
    assert {body["output"]["pid"] for body in final} <= pids
