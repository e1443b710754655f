"""Three real `thaw serve` instances on one PostgreSQL database behind nginx:
requests spread over every instance, and a job accepted by any of them is
answered by every other, whichever one a poll reaches."""

from __future__ import annotations

from tests.fleet.conftest import MakeFleet


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
