"""Jobs belong to the key that created them: any other key sees 404, as for a job
that does not exist, so job ids cannot be probed; ids are 192 random bits."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from runtime.jobs.job import new_job_id
from tests.security.conftest import PROBLEM, Launch, bearer, key_id_of
from tests.support import ServerProcess

KEY_A = "key-a-5f0e2c71"
KEY_B = "key-b-9d4a6b30"
URL_SAFE = re.compile(r"^[A-Za-z0-9_-]+$")


@pytest.fixture(scope="module")
def server(launch_module: Launch) -> ServerProcess:
    return launch_module(
        THAW_API_KEYS=f"{KEY_A},{KEY_B}", THAW_HANDLERS="handlers.echo,tests.handlers.sleepy"
    )


def submit(
    server: ServerProcess, key: str, event: object, handler: str = "echo"
) -> dict[str, object]:
    response = httpx.post(f"{server.url}/handlers/{handler}/jobs", json=event, headers=bearer(key))
    assert response.status_code == 202, response.text
    job: dict[str, object] = response.json()
    return job


def test_another_key_gets_404_for_read_and_cancel_the_owner_gets_the_job(
    server: ServerProcess,
) -> None:
    job = submit(server, KEY_A, {"owner": "a"})
    path = f"{server.url}/jobs/{job['id']}"
    unknown = f"{server.url}/jobs/{new_job_id()}"

    for method in ("GET", "DELETE"):
        other = httpx.request(method, path, headers=bearer(KEY_B))
        assert other.status_code == 404, other.text
        assert other.headers["content-type"] == PROBLEM
        # Indistinguishable from a job that does not exist (apart from the id echoed).
        missing = httpx.request(method, unknown, headers=bearer(KEY_B)).json()
        seen = other.json()
        assert seen["type"] == missing["type"] and seen["type"].endswith("/unknown-job")
        assert seen["detail"].replace(str(job["id"]), "ID") == missing["detail"].replace(
            unknown.rsplit("/", 1)[1], "ID"
        )
        assert "owner" not in other.text

    mine = httpx.get(path, params={"wait": 10}, headers=bearer(KEY_A))
    assert mine.status_code == 200
    assert mine.json()["status"] == "succeeded" and mine.json()["output"] == {"owner": "a"}
    # B's cancel above did nothing to A's job.
    assert httpx.delete(path, headers=bearer(KEY_A)).json()["status"] == "succeeded"


def test_only_the_owner_can_cancel_a_running_job(server: ServerProcess) -> None:
    job = submit(server, KEY_A, {"s": 30}, handler="sleepy")
    path = f"{server.url}/jobs/{job['id']}"
    assert httpx.delete(path, headers=bearer(KEY_B)).status_code == 404
    assert httpx.get(path, headers=bearer(KEY_A)).json()["status"] == "running"
    cancelled = httpx.delete(path, headers=bearer(KEY_A))
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"


def test_the_store_holds_the_key_id_never_the_key(server: ServerProcess) -> None:
    submit(server, KEY_B, {"n": 1})
    state = Path(server.env["THAW_JOB_STORE"].removeprefix("sqlite:///"))
    stored = b"".join(p.read_bytes() for p in state.parent.glob(state.name + "*"))
    assert key_id_of(KEY_B).encode() in stored
    assert KEY_A.encode() not in stored and KEY_B.encode() not in stored


def test_job_ids_are_192_bit_url_safe_and_unique(server: ServerProcess) -> None:
    served = [str(submit(server, KEY_A, {})["id"]) for _ in range(5)]
    ids = served + [new_job_id() for _ in range(2000)]
    for job_id in ids:
        # 24 random bytes in unpadded base64url: 32 characters, 192 bits.
        assert len(job_id) == 32 and URL_SAFE.match(job_id), job_id
    assert len(set(ids)) == len(ids)
