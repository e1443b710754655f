"""Storage faults against a real `thaw serve`: a full disk (a small tmpfs holding the
job store and the state dir), the SQLite file deleted or overwritten while the
server runs, and a state dir that cannot be created (in-process: one app, its log captured).

The rules: a store that cannot write answers 503 storage-unavailable with
Retry-After, never 500 and never a 202 for a job it did not record; /readyz is
503 while it lasts, logged once when it starts and once when it ends; a finished
output is never lost nor computed twice; an unusable state dir costs estimates
and stamps, never a model load.
"""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from runtime.bundles.stamps import RACY_S
from runtime.settings import Settings
from tests.handlers.runlog import runs
from tests.inproc import answer_once, answers_once, captured_logs, serving
from tests.jobs import tmpfs
from tests.support import SAFETY_S, ServerProcess, make_bundle, until

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)

PROBLEM_TYPE = "https://thaw.dev/problems/storage-unavailable"
Serve = Callable[..., ServerProcess]


@pytest.fixture
def serve_at(servers: list[ServerProcess], server_env: dict[str, str], tmp_path: Path) -> Serve:
    """Start a server whose log lives outside any disk a test fills or breaks."""

    def start(**env: str) -> ServerProcess:
        server = ServerProcess(
            {
                **server_env,
                "THAW_HANDLERS": "tests.handlers.runlog,tests.handlers.loadlog",
                "THAW_TEST_RUN_LOG": str(tmp_path / "runs.log"),
                **env,
            }
        )
        server.log_path = tmp_path / f"server-{server.port}.log"
        servers.append(server)
        return server.start()

    return start


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    with tmpfs.mounted(tmp_path / "disk", "8m") as mounted:
        yield mounted


def restart_settings(server: ServerProcess) -> Settings:
    """The settings of a server started again on `server`'s state, with the
    default lease (the short ones here make a lease lapse during an outage)."""
    env = {k: v for k, v in server.env.items() if k != "THAW_JOB_LEASE_S"}
    return Settings.from_env(env)


def assert_storage_unavailable(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    assert response.json()["type"] == PROBLEM_TYPE
    assert int(response.headers["retry-after"]) >= 1


def readiness(client: httpx.Client) -> tuple[int, list[str]]:
    response = client.get("/readyz")
    body = response.json()
    return response.status_code, [c["condition"] for c in body.get("conditions", [])]


def count(log: str, text: str) -> int:
    return sum(text in line for line in log.splitlines())


def test_a_full_disk_refuses_jobs_with_503_and_keeps_a_finished_output(
    serve_at: Serve, disk: Path, tmp_path: Path, bundles: Path
) -> None:
    make_bundle(bundles, "alpha")
    hold = tmp_path / "hold"
    hold.touch()
    run_log = tmp_path / "runs.log"
    server = serve_at(
        THAW_JOB_STORE=f"sqlite:///{disk / 'jobs.sqlite3'}",
        THAW_STATE_DIR=str(disk / "state"),
        THAW_JOB_LEASE_S="1",  # lapses during the outage; the sweep runs every second
    )
    with server.client() as client:
        held = client.post("/handlers/logged/jobs", json={"tag": "held", "hold": str(hold)})
        assert held.status_code == 202
        held_id = held.json()["id"]
        until(lambda: runs(run_log, "held"), "the held job started")

        filler = tmpfs.fill(disk)
        for _ in range(3):
            assert_storage_unavailable(
                client.post("/handlers/logged/jobs", json={"tag": "refused"})
            )
            assert_storage_unavailable(
                client.post(
                    "/invoke/logged", json={"tag": "refused"}, headers={"Prefer": "respond-async"}
                )
            )
        assert readiness(client) == (503, ["job-store"])
        # Work that needs no job record is still served, model loads included
        # (their estimates cannot be saved on the full state dir).
        assert client.post("/invoke/logged", json={"tag": "sync"}).status_code == 200
        loaded = client.post("/invoke/alpha", json={}, headers={"Prefer": "wait=120"})
        assert loaded.status_code == 200, loaded.text

        hold.unlink()  # the held job finishes while its outcome cannot be written
        until(lambda: "held end" in run_log.read_text(), "the held job ended")
        store = sqlite3.connect(f"file:{disk / 'jobs.sqlite3'}?mode=ro", uri=True)
        lease_until = store.execute(
            "SELECT lease_until FROM jobs WHERE id = ?", (held_id,)
        ).fetchone()[0]
        store.close()
        # Past its lease and two sweeps (the old code re-ran it here, once space came back).
        until(lambda: time.time() > lease_until + 2.5, "the lease lapsed", timeout_s=SAFETY_S)
        assert client.get(f"/jobs/{held_id}").json()["status"] == "running"
        assert readiness(client)[0] == 503

        tmpfs.free(filler)
        done = client.get(f"/jobs/{held_id}", params={"wait": 30}).json()
        assert done["status"] == "succeeded", done
        assert done["attempts"] == 1 and done["output"]["tag"] == "held"
        until(lambda: readiness(client) == (200, []), "ready again")
        accepted = client.post("/handlers/logged/jobs", json={"tag": "after"})
        assert accepted.status_code == 202
        after_id = accepted.json()["id"]
        assert client.get(f"/jobs/{after_id}", params={"wait": 30}).json()["status"] == (
            "succeeded"
        )

    assert len(runs(run_log, "held")) == 1, "the finished job was run again"
    assert runs(run_log, "refused") == []
    # The whole log: the tail `log()` keeps is mostly access lines by now.
    log = server.log_path.read_text()
    assert count(log, "unready: job-store") == 1, log
    assert count(log, "ready again: job-store") == 1, log
    assert count(log, "load estimates cannot be saved") == 1, log
    assert count(log, "Traceback") == 0, log

    server.terminate()
    # Restarted on the same state (in-process: what the store kept is the point).
    kept, after = answers_once(
        restart_settings(server), [("GET", f"/jobs/{held_id}"), ("GET", f"/jobs/{after_id}")]
    )
    assert kept.json()["status"] == "succeeded" and kept.json()["output"] == done["output"]
    assert after.json()["status"] == "succeeded"


@pytest.mark.parametrize("side_files_too", [False, True], ids=["rm-db", "rm-db-wal-shm"])
def test_a_job_database_deleted_while_serving_loses_no_accepted_job(
    serve_at: Serve, tmp_path: Path, side_files_too: bool
) -> None:
    database = tmp_path / "jobs.sqlite3"
    hold = tmp_path / "hold"
    hold.touch()
    server = serve_at(THAW_JOB_STORE=f"sqlite:///{database}", THAW_JOB_LEASE_S="1")
    with server.client() as client:
        held_id = client.post(
            "/handlers/logged/jobs", json={"tag": "held", "hold": str(hold)}
        ).json()["id"]
        until(lambda: runs(tmp_path / "runs.log", "held"), "the held job started")
        database.unlink()
        if side_files_too:
            for suffix in ("-wal", "-shm"):
                Path(f"{database}{suffix}").unlink(missing_ok=True)

        accepted = []
        for index in range(5):
            response = client.post("/handlers/logged/jobs", json={"tag": f"new-{index}"})
            if response.status_code == 503:  # refused: fine, as long as it is not a 202
                assert_storage_unavailable(response)
            else:
                assert response.status_code == 202, response.text
                accepted.append(response.json()["id"])
        assert accepted, "the store never reopened on the new file"
        hold.unlink()
        for job_id in [held_id, *accepted]:
            final = client.get(f"/jobs/{job_id}", params={"wait": 30}).json()
            assert final["status"] == "succeeded", final
    # The whole log: the tail `log()` keeps is mostly access lines by now.
    log = server.log_path.read_text()
    assert count(log, "now using the file at that path") == 1, log
    # A write that raced the deletion was refused (readiness off, then back), or none did.
    assert count(log, "unready: job-store") == count(log, "ready again: job-store") <= 1, log

    server.kill()  # no clean shutdown: what was acknowledged must be on disk
    kept = answers_once(
        restart_settings(server), [("GET", f"/jobs/{job_id}") for job_id in [held_id, *accepted]]
    )
    for answer in kept:
        assert answer.json()["status"] == "succeeded", answer.json()
    assert sqlite3.connect(database).execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_a_job_database_overwritten_while_serving_is_refused_until_removed(
    serve_at: Serve, tmp_path: Path
) -> None:
    database = tmp_path / "jobs.sqlite3"
    server = serve_at(THAW_JOB_STORE=f"sqlite:///{database}")
    with server.client() as client:
        first = client.post("/handlers/logged/jobs", json={"tag": "first"}).json()["id"]
        assert client.get(f"/jobs/{first}", params={"wait": 30}).json()["status"] == "succeeded"
        with open(database, "r+b") as handle:  # garbage over the header, same inode
            handle.write(os.urandom(16384))

        for _ in range(3):
            assert_storage_unavailable(
                client.post("/handlers/logged/jobs", json={"tag": "refused"})
            )
        # A finished job this instance has seen is answered from memory
        # (runtime/jobs/finished.py): its result stays readable meanwhile.
        kept = client.get(f"/jobs/{first}")
        assert kept.status_code == 200 and kept.json()["output"]["tag"] == "first"
        assert readiness(client) == (503, ["job-store"])

        database.unlink()  # the operator removes the broken file
        accepted = until(
            lambda: (
                (r := client.post("/handlers/logged/jobs", json={"tag": "after"})).status_code
                == 202
                and r.json()["id"]
            ),
            "a job accepted on the new file",
        )
        assert client.get(f"/jobs/{accepted}", params={"wait": 30}).json()["status"] == (
            "succeeded"
        )
        until(lambda: readiness(client) == (200, []), "ready again")
    assert runs(tmp_path / "runs.log", "refused") == []
    # The whole log: the tail `log()` keeps is mostly access lines by now.
    log = server.log_path.read_text()
    assert count(log, "unready: job-store") == 1, log
    assert count(log, "ready again: job-store") == 1, log

    server.kill()
    kept_job = answer_once(restart_settings(server), "GET", f"/jobs/{accepted}").json()
    assert kept_job["status"] == "succeeded"


@pytest.mark.anyio
async def test_a_state_dir_that_cannot_be_created_costs_estimates_never_loads(
    app_settings: Settings, tmp_path: Path, bundles: Path
) -> None:
    make_bundle(bundles, "alpha")
    make_bundle(bundles, "beta")
    # Stamps are saved only for files that had settled before verification began
    # (their ctime cannot be set back: this waits for the filesystem's clock).
    time.sleep(RACY_S + 0.2)
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the state dir's parent should be")
    settings = dataclasses.replace(app_settings, state_dir=str(blocker / "state"))
    with captured_logs() as logs:
        async with serving(settings) as served:
            client = served.client
            for name in ("alpha", "beta", "alpha"):
                response = await client.post(
                    f"/invoke/{name}", json={}, headers={"Prefer": "wait=120"}
                )
                assert response.status_code == 200, response.text
            job = (await client.post("/handlers/beta/jobs", json={})).json()
            final = await client.get(f"/jobs/{job['id']}", params={"wait": 30})
            assert final.json()["status"] == "succeeded"
            ready = await client.get("/readyz")
            assert (ready.status_code, ready.json().get("conditions", [])) == (200, [])
    log = logs.text
    assert count(log, "load estimates cannot be saved") == 1, log
    assert count(log, "verified-file stamps cannot be saved") == 1, log
    assert count(log, "dead-owner recovery is off") == 1, log
