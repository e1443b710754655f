"""Start-up of a real server: what happens after it listens."""

from __future__ import annotations

from pathlib import Path

from tests.support import ServerProcess


def test_a_job_store_that_cannot_open_ends_the_process_with_exit_1(
    servers: list[ServerProcess], server_env: dict[str, str], tmp_path: Path
) -> None:
    # The store is opened once the server listens (so /healthz does not wait
    # on it); failing to open it must still end the process, not leave it up.
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    env = {**server_env, "THAW_JOB_STORE": f"sqlite:///{blocker / 'jobs.sqlite3'}"}
    server = ServerProcess(env)
    servers.append(server)
    server.start(wait=False)
    assert server.proc is not None
    assert server.proc.wait(20) == 1
    assert "start-up failed" in server.log()


def test_a_job_submitted_as_soon_as_healthz_answers_is_recorded(
    servers: list[ServerProcess], server_env: dict[str, str]
) -> None:
    server = ServerProcess(server_env)
    servers.append(server)
    server.start()
    with server.client() as client:
        job = client.post("/handlers/echo/jobs", json={"at": "start"})
        assert job.status_code == 202, job.text
        # No answer names the server's software (runtime/http/server.py).
        assert "server" not in job.headers and "date" in job.headers
        done = client.get(f"/jobs/{job.json()['id']}", params={"wait": 10}).json()
        assert done["status"] == "succeeded" and done["output"] == {"at": "start"}
        metrics = client.get("/metrics").text
        assert 'thaw_jobs_total{status="succeeded"} 1.0' in metrics
        assert 'thaw_queue_depth{handler="echo"}' in metrics
