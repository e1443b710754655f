"""Jobs survive restarts; a job whose instance died is retried, never stuck running.

A process killed mid-job is the point of the first two tests (real `thaw serve`
processes, SIGKILLed); expiry is the job store's and runs in-process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from runtime.settings import Settings
from tests.inproc import serving
from tests.inproc import until as until_async
from tests.support import ServerProcess, make_bundle, until


def test_finished_jobs_survive_restart_and_killed_job_is_retried(
    serve: Any, bundles: Path, tmp_path: Path
) -> None:
    make_bundle(bundles, "alpha")
    hold = tmp_path / "hold"  # the job runs until the kill, however slow the machine
    hold.touch()
    first: ServerProcess = serve(THAW_JOB_LEASE_S="1")
    with first.client() as client:
        done = client.post("/handlers/alpha/jobs", json={}).json()
        assert client.get(f"/jobs/{done['id']}", params={"wait": 20}).json()["status"] == (
            "succeeded"
        )
        running = client.post("/handlers/alpha/jobs", json={"hold_file": str(hold)}).json()
        status = until(
            lambda: (s := client.get(f"/jobs/{running['id']}").json()["status"]) != "queued" and s,
            "the job left the queue",
        )
        assert status == "running"
    first.kill()  # SIGKILL mid-job: no chance to clean up
    hold.unlink()  # the retry runs to its end

    second: ServerProcess = serve(THAW_JOB_LEASE_S="1")
    with second.client() as client:
        kept = client.get(f"/jobs/{done['id']}").json()
        assert kept["status"] == "succeeded" and kept["output"]["bundle"] == "alpha"
        recovered = client.get(f"/jobs/{running['id']}", params={"wait": 30}).json()
        assert recovered["status"] == "succeeded", recovered
        assert recovered["attempts"] == 2
        assert recovered["output"]["pid"] == second.proc.pid  # type: ignore[union-attr]


def test_job_out_of_attempts_fails_with_clear_error(
    serve: Any, bundles: Path, tmp_path: Path
) -> None:
    make_bundle(bundles, "alpha")
    hold = tmp_path / "hold"  # the job never ends on its own: only the kill ends it
    hold.touch()
    env = {"THAW_JOB_LEASE_S": "0.5", "THAW_JOB_MAX_ATTEMPTS": "1"}
    first: ServerProcess = serve(**env)
    with first.client() as client:
        job = client.post("/handlers/alpha/jobs", json={"hold_file": str(hold)}).json()
        until(
            lambda: client.get(f"/jobs/{job['id']}").json()["status"] == "running",
            "the job started",
        )
    first.kill()
    second: ServerProcess = serve(**env)
    with second.client() as client:
        # Its lease lapses (0.5 s after the kill at most); a poll then finds it out of attempts.
        final = until(
            lambda: (j := client.get(f"/jobs/{job['id']}").json())["status"] != "running" and j,
            "the dead job was settled",
        )
        assert final["status"] == "failed"
        assert final["error"]["type"] == "worker-lost"
        assert "1 attempts" in final["error"]["message"]


@pytest.mark.process
@pytest.mark.anyio
async def test_jobs_expire_after_ttl(app_settings: Settings, bundles: Path) -> None:
    make_bundle(bundles, "alpha")
    async with serving(dataclasses.replace(app_settings, job_ttl_s=1.0)) as served:
        client = served.client
        job = (await client.post("/handlers/alpha/jobs", json={})).json()
        assert (await client.get(f"/jobs/{job['id']}", params={"wait": 10})).status_code == 200

        async def gone() -> bool:
            return (await client.get(f"/jobs/{job['id']}")).status_code == 404

        await until_async(gone, "the job expired")


@pytest.mark.anyio
async def test_a_job_whose_work_ended_before_its_answer_is_answered_final(
    app_settings: Settings,
) -> None:
    """An async handler that never waits ends in its first step: its outcome is written
    before the 202 is sent, so the 202 carries the final job, durable in the store; a
    job still running when its answer goes is answered running, as before."""
    handlers = ("handlers.echo", "tests.handlers.sleepy")
    async with serving(dataclasses.replace(app_settings, handlers=handlers)) as served:
        accepted = await served.client.post("/handlers/echo/jobs", json={"n": 1})
        assert accepted.status_code == 202
        job = accepted.json()
        assert (job["status"], job["output"]) == ("succeeded", {"n": 1})
        # Its result is in the answer: nothing to wait for before polling.
        assert accepted.headers["retry-after"] == "0"
        assert accepted.headers["location"] == f"/jobs/{job['id']}"
        stored = store_row(app_settings, job["id"])
        assert stored == ("succeeded", b'{"n":1}')
        polled = await served.client.get(f"/jobs/{job['id']}")
        assert polled.json() == job

        running = await served.client.post("/handlers/sleepy/jobs", json={"s": 0.05})
        assert running.status_code == 202
        assert running.json()["status"] in ("queued", "running")
        assert int(running.headers["retry-after"]) >= 1
        done = await served.client.get(f"/jobs/{running.json()['id']}", params={"wait": 60})
        assert done.json()["status"] == "succeeded"


@pytest.mark.anyio
async def test_job_writes_wait_for_a_store_locked_elsewhere_off_the_loop(
    app_settings: Settings,
) -> None:
    """Another process holding the job database's write lock: a submission's record
    waits for it in a worker thread (a call run at once on the loop would busy-wait
    there), so the loop serves meanwhile, and the job is recorded once it is free."""
    settings = dataclasses.replace(app_settings, handlers=("handlers.echo",))
    async with serving(settings) as served:
        # The store is open (and its connections) once a first job is recorded.
        assert (await served.client.post("/handlers/echo/jobs", json={})).status_code == 202
        other = sqlite3.connect(Path(settings.job_store.removeprefix("sqlite:///")))
        other.isolation_level = None
        other.execute("BEGIN IMMEDIATE")
        try:
            submit = asyncio.ensure_future(served.client.post("/handlers/echo/jobs", json={}))
            # The loop answers while the record waits for the lock.
            for _ in range(3):
                assert (await served.client.get("/healthz")).status_code == 200
            assert not submit.done()
        finally:
            other.execute("ROLLBACK")
            other.close()
        accepted = await submit
        assert accepted.status_code == 202, accepted.text
        assert store_row(settings, accepted.json()["id"])[0] == "succeeded"


def store_row(settings: Settings, job_id: str) -> tuple[str, bytes]:
    """(status, output) of a job as another connection reads the job database."""
    path = Path(settings.job_store.removeprefix("sqlite:///"))
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        status, output = conn.execute(
            "SELECT status, output FROM jobs WHERE id = ?", (job_id,)
        ).fetchone()
    finally:
        conn.close()
    return status, output if isinstance(output, bytes) else str(output).encode()
