"""The in-process harness (tests/inproc.py) runs the app's lifespan as a server does:
the instance starts before the first request and is drained after the last (work
in flight finishes and is recorded); a start-up that fails raises the app's own
error."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.jobs.job import JobStatus
from runtime.jobs.stores.sqlite import SQLiteJobStore
from tests.inproc import listening, serving, settings_for

pytestmark = pytest.mark.anyio


async def test_the_lifespan_starts_the_instance_and_stops_it(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, handlers=("tests.handlers.sleepy",))
    async with serving(settings) as served:
        assert served.instance.store.opened  # started with its background work
        answer = await served.client.post("/handlers/sleepy/jobs", json={"s": 0.2})
        assert answer.status_code == 202
        instance = served.instance
    assert instance.draining
    # The job in flight at the block's end finished during the drain, and was recorded.
    store = SQLiteJobStore(tmp_path / "jobs.sqlite3", ttl_s=3600)
    try:
        job = store.get(answer.json()["id"])
    finally:
        store.close()
    assert job is not None and job.status is JobStatus.SUCCEEDED


async def test_a_start_up_that_fails_raises_the_apps_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    settings = settings_for(
        tmp_path, handlers=("handlers.echo",), job_store=f"sqlite:///{blocker / 'jobs.sqlite3'}"
    )
    with pytest.raises(OSError):
        async with serving(settings):
            pass


async def test_listening_serves_on_loopback_and_stops(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, handlers=("handlers.echo",))
    async with listening(settings) as server:
        assert server.url.startswith("http://127.0.0.1:")
        async with server.client() as client:
            assert (await client.post("/invoke/echo", json={"x": 1})).json() == {"x": 1}
        instance = server.instance
    assert instance.draining
