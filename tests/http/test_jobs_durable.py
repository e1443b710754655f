"""Jobs survive restarts; a job whose instance died is retried, never stuck running."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tests.support import ServerProcess, make_bundle


def test_finished_jobs_survive_restart_and_killed_job_is_retried(serve: Any, bundles: Path) -> None:
    make_bundle(bundles, "alpha")
    first: ServerProcess = serve(THAW_JOB_LEASE_S="1")
    with first.client() as client:
        done = client.post("/handlers/alpha/jobs", json={}).json()
        assert client.get(f"/jobs/{done['id']}", params={"wait": 20}).json()["status"] == (
            "succeeded"
        )
        running = client.post("/handlers/alpha/jobs", json={"sleep_s": 2.0}).json()
        time.sleep(0.5)
        assert client.get(f"/jobs/{running['id']}").json()["status"] == "running"
    first.kill()  # SIGKILL mid-job: no chance to clean up

    second: ServerProcess = serve(THAW_JOB_LEASE_S="1")
    with second.client() as client:
        kept = client.get(f"/jobs/{done['id']}").json()
        assert kept["status"] == "succeeded" and kept["output"]["bundle"] == "alpha"
        recovered = client.get(f"/jobs/{running['id']}", params={"wait": 30}).json()
        assert recovered["status"] == "succeeded", recovered
        assert recovered["attempts"] == 2
        assert recovered["output"]["pid"] == second.proc.pid  # type: ignore[union-attr]


def test_job_out_of_attempts_fails_with_clear_error(serve: Any, bundles: Path) -> None:
    make_bundle(bundles, "alpha")
    env = {"THAW_JOB_LEASE_S": "0.5", "THAW_JOB_MAX_ATTEMPTS": "1"}
    first: ServerProcess = serve(**env)
    with first.client() as client:
        job = client.post("/handlers/alpha/jobs", json={"sleep_s": 5}).json()
        time.sleep(0.5)
    first.kill()
    second: ServerProcess = serve(**env)
    with second.client() as client:
        time.sleep(0.6)
        final = client.get(f"/jobs/{job['id']}").json()
        assert final["status"] == "failed"
        assert final["error"]["type"] == "worker-lost"
        assert "1 attempts" in final["error"]["message"]


def test_jobs_expire_after_ttl(serve: Any, bundles: Path) -> None:
    make_bundle(bundles, "alpha")
    server: ServerProcess = serve(THAW_JOB_TTL_S="1")
    with server.client() as client:
        job = client.post("/handlers/alpha/jobs", json={}).json()
        assert client.get(f"/jobs/{job['id']}", params={"wait": 10}).status_code == 200
        time.sleep(1.2)
        assert client.get(f"/jobs/{job['id']}").status_code == 404
