"""Jobs belong to the key that created them: any other key sees 404, as for a job
that does not exist, so job ids cannot be probed; ids are 192 random bits."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from runtime.jobs.job import new_job_id
from tests.inproc import Served, serving
from tests.security.conftest import PROBLEM, bearer, key_id_of, light_settings

pytestmark = pytest.mark.anyio

KEY_A = "key-a-5f0e2c71"
KEY_B = "key-b-9d4a6b30"
URL_SAFE = re.compile(r"^[A-Za-z0-9_-]+$")


@pytest.fixture(scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Served]:
    settings = light_settings(
        tmp_path_factory.mktemp("server"),
        api_keys=(KEY_A, KEY_B),
        handlers=("handlers.echo", "tests.handlers.sleepy"),
    )
    async with serving(settings) as served:
        yield served


async def submit(
    server: Served, key: str, event: object, handler: str = "echo"
) -> dict[str, object]:
    response = await server.client.post(
        f"/handlers/{handler}/jobs", json=event, headers=bearer(key)
    )
    assert response.status_code == 202, response.text
    job: dict[str, object] = response.json()
    return job


async def test_another_key_gets_404_for_read_and_cancel_the_owner_gets_the_job(
    server: Served,
) -> None:
    job = await submit(server, KEY_A, {"owner": "a"})
    path = f"/jobs/{job['id']}"
    unknown = f"/jobs/{new_job_id()}"

    for method in ("GET", "DELETE"):
        other = await server.client.request(method, path, headers=bearer(KEY_B))
        assert other.status_code == 404, other.text
        assert other.headers["content-type"] == PROBLEM
        # Indistinguishable from a job that does not exist (apart from the id echoed).
        missing = (await server.client.request(method, unknown, headers=bearer(KEY_B))).json()
        seen = other.json()
        assert seen["type"] == missing["type"] and seen["type"].endswith("/unknown-job")
        assert seen["detail"].replace(str(job["id"]), "ID") == missing["detail"].replace(
            unknown.rsplit("/", 1)[1], "ID"
        )
        assert "owner" not in other.text

    mine = await server.client.get(path, params={"wait": 10}, headers=bearer(KEY_A))
    assert mine.status_code == 200
    assert mine.json()["status"] == "succeeded" and mine.json()["output"] == {"owner": "a"}
    # B's cancel above did nothing to A's job.
    assert (await server.client.delete(path, headers=bearer(KEY_A))).json()["status"] == "succeeded"


async def test_only_the_owner_can_cancel_a_running_job(server: Served) -> None:
    job = await submit(server, KEY_A, {"s": 30}, handler="sleepy")
    path = f"/jobs/{job['id']}"
    assert (await server.client.delete(path, headers=bearer(KEY_B))).status_code == 404
    assert (await server.client.get(path, headers=bearer(KEY_A))).json()["status"] == "running"
    cancelled = await server.client.delete(path, headers=bearer(KEY_A))
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"


async def test_the_store_holds_the_key_id_never_the_key(server: Served) -> None:
    await submit(server, KEY_B, {"n": 1})
    state = Path(server.settings.job_store.removeprefix("sqlite:///"))
    stored = b"".join(p.read_bytes() for p in state.parent.glob(state.name + "*"))
    assert key_id_of(KEY_B).encode() in stored
    assert KEY_A.encode() not in stored and KEY_B.encode() not in stored


async def test_job_ids_are_192_bit_url_safe_and_unique(server: Served) -> None:
    served = [str((await submit(server, KEY_A, {}))["id"]) for _ in range(5)]
    ids = served + [new_job_id() for _ in range(2000)]
    for job_id in ids:
        # 24 random bytes in unpadded base64url: 32 characters, 192 bits.
        assert len(job_id) == 32 and URL_SAFE.match(job_id), job_id
    assert len(set(ids)) == len(ids)
