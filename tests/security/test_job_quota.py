"""Stored jobs are bounded per key and in total, by count and by bytes: past a
bound a new job is 429 `quota-exceeded` with Retry-After (413 for one input
larger than a whole share), each job counted until its retention ends; and
another key's finished job is looked up as an unknown id is, in the store."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from runtime.clock import ManualClock
from runtime.errors import PayloadTooLarge, QuotaExceeded, UnknownJob
from runtime.jobs.job import Job, JobStatus
from runtime.jobs.manager import JobManager
from runtime.jobs.quota import JobQuota, Limits
from runtime.jobs.stores.sqlite import SQLiteJobStore
from runtime.telemetry.metrics import Metrics
from tests.security.inprocess import TENANT_A, TENANT_B, auth, serving, settings_under

pytestmark = pytest.mark.anyio


async def test_jobs_per_key_then_in_total(tmp_path: Path) -> None:
    settings = settings_under(tmp_path, max_jobs_per_key=3, max_jobs=5, max_job_bytes_per_key=4096)
    async with serving(settings) as (_, client):
        submit = "/handlers/echo/jobs"
        for _ in range(3):
            assert (
                await client.post(submit, json={"n": 1}, headers=auth(TENANT_A))
            ).status_code == 202
        refused = await client.post(submit, json={"n": 1}, headers=auth(TENANT_A))
        assert refused.status_code == 429, refused.text
        assert refused.headers["content-type"] == "application/problem+json"
        problem = refused.json()
        assert problem["type"].endswith("/quota-exceeded")
        assert "THAW_MAX_JOBS_PER_KEY=3" in problem["detail"]
        assert int(refused.headers["retry-after"]) > 3600  # the oldest job's retention
        # Another key has its own share, up to the instance's bound.
        for _ in range(2):
            assert (
                await client.post(submit, json={"n": 2}, headers=auth(TENANT_B))
            ).status_code == 202
        full = await client.post(submit, json={"n": 2}, headers=auth(TENANT_B))
        assert full.status_code == 429
        assert "THAW_MAX_JOBS=5" in full.json()["detail"]
        # Invocations that finish in time store nothing: they are still served.
        served = await client.post("/invoke/echo", json={"n": 3}, headers=auth(TENANT_B))
        assert served.status_code == 200


async def test_stored_bytes_per_key_and_one_input_too_large(tmp_path: Path) -> None:
    settings = settings_under(tmp_path, max_job_bytes_per_key=10_000)
    async with serving(settings) as (_, client):
        submit = "/handlers/echo/jobs"
        # echo stores its input and, once done, the same bytes as its output.
        first = await client.post(submit, json={"pad": "x" * 3000}, headers=auth(TENANT_A))
        assert first.status_code == 202
        done = await client.get(
            first.headers["location"], params={"wait": 10}, headers=auth(TENANT_A)
        )
        assert done.json()["status"] == "succeeded"
        # ~6 KB held (its input and its output): another 4.5 KB would pass 10 000 bytes.
        refused = await client.post(submit, json={"pad": "y" * 4500}, headers=auth(TENANT_A))
        assert refused.status_code == 429
        assert "THAW_MAX_JOB_BYTES_PER_KEY=10000" in refused.json()["detail"]
        huge = await client.post(submit, json={"pad": "z" * 20_000}, headers=auth(TENANT_B))
        assert huge.status_code == 413
        assert huge.json()["type"].endswith("/payload-too-large")
        assert (await client.post(submit, json={}, headers=auth(TENANT_B))).status_code == 202


def test_a_job_stops_counting_when_its_retention_ends() -> None:
    clock = ManualClock()
    quota = JobQuota(Limits(2, 1000, 10, 10_000), ttl_s=60.0, clock=clock)
    quota.admit("k", 100)
    quota.add("j1", "k", 100)
    clock.advance(30.0)
    quota.add("j2", "k", 100)
    with pytest.raises(QuotaExceeded) as info:
        quota.admit("k", 100)
    assert info.value.retry_after_s == 30.0  # until j1's retention ends
    clock.advance(30.0)
    quota.admit("k", 100)  # j1 expired: room again
    quota.add("j3", "k", 100)
    quota.add("m1", "m", 100)
    quota.grow("m1", 850)  # its output, once recorded
    with pytest.raises(QuotaExceeded, match="THAW_MAX_JOB_BYTES_PER_KEY=1000"):
        quota.admit("m", 100)
    with pytest.raises(PayloadTooLarge):
        quota.admit("other", 1001)
    assert quota.total.jobs == 3 and quota.by_key["m"].size == 950
    clock.advance(120.0)
    quota.admit("k", 1000)
    assert quota.total.jobs == 0 and quota.by_key == {}


class CountedStore:
    """A real SQLite store that counts the reads it serves."""

    def __init__(self, path: Path) -> None:
        self.inner = SQLiteJobStore(path, ttl_s=60.0)
        self.reads = 0

    def get(self, job_id: str) -> Job | None:
        self.reads += 1
        return self.inner.get(job_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_another_keys_finished_job_is_looked_up_as_an_unknown_id(tmp_path: Path) -> None:
    """No timing oracle: a finished job of another key takes the path a random id
    takes (a store read), not the owner's answer from memory."""
    store = CountedStore(tmp_path / "jobs.sqlite3")
    jobs = JobManager(store, owner="here", lease_s=5.0, max_attempts=2, metrics=Metrics())
    job = await jobs.record("echo", {"x": 1}, phase="running", key_id="owner")
    jobs.follow(job, asyncio.ensure_future(asyncio.sleep(0, {"x": 1})), lambda: ("running", None))
    await jobs.wait_idle()
    assert (await jobs.get(job.id, key_id="owner")).status is JobStatus.SUCCEEDED
    answers = {}
    for probe in (job.id, "an-id-nobody-made-0000000000000000"):
        store.reads = 0
        with pytest.raises(UnknownJob) as info:
            await jobs.get(probe, key_id="intruder")
        answers[probe] = (store.reads, type(info.value), info.value.status)
        store.reads = 0
        with pytest.raises(UnknownJob):
            await jobs.cancel(probe, key_id="intruder")
        assert store.reads == 1, probe
    assert answers[job.id] == answers["an-id-nobody-made-0000000000000000"]
    assert answers[job.id][0] == 1
    jobs.close()
