"""Start-up order: what an instance defers until the server listens, and that
requests arriving before that deferred work finished are still served."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

import runtime.jobs.store
from runtime.dispatch.dispatcher import Accepted, Completed
from runtime.instance import Instance
from runtime.jobs.job import JobStatus
from runtime.jobs.store import JobStore
from runtime.registry import discover
from runtime.settings import Settings

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def settings_for(tmp_path: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "bundle_source": str(tmp_path / "bundles"),
        "cache_dir": str(tmp_path / "cache"),
        "state_dir": str(tmp_path / "state"),
        "job_store": f"sqlite:///{tmp_path / 'jobs.sqlite3'}",
        "handlers": ("tests.handlers.echo",),
        **overrides,
    }
    return Settings(**values)


@pytest.fixture
def slow_open(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Opening a store takes 0.5 s; returns the times each open began."""
    real_open = runtime.jobs.store.open_store
    began: list[float] = []

    def open_store(url: str, *, ttl_s: float) -> JobStore:
        began.append(time.monotonic())
        time.sleep(0.5)
        return real_open(url, ttl_s=ttl_s)

    monkeypatch.setattr(runtime.jobs.store, "open_store", open_store)
    return began


async def test_creating_an_instance_opens_no_store(tmp_path: Path) -> None:
    settings = settings_for(tmp_path)
    instance = Instance.create(settings, discover(settings.handlers))
    assert not instance.store.opened
    assert not (tmp_path / "jobs.sqlite3").exists()
    await instance.start()  # background=True: prepared before it returns
    try:
        assert instance.store.opened
    finally:
        await instance.stop()


async def test_requests_during_background_start_are_served(
    tmp_path: Path, slow_open: list[float]
) -> None:
    settings = settings_for(tmp_path)
    instance = Instance.create(settings, discover(settings.handlers))
    await instance.start(background=False)  # as the server's lifespan does
    errors: list[Exception] = []
    instance.start_background(on_error=errors.append)  # as the server does once listening
    try:
        # Both arrive while the store is still being opened in a worker thread.
        started = time.monotonic()
        sync, queued = await asyncio.gather(
            instance.dispatcher.invoke("echo", {"n": 1}, wait_s=5.0, request_id="a"),
            instance.dispatcher.invoke("echo", {"n": 2}, respond_async=True, request_id="b"),
        )
        assert isinstance(sync, Completed) and sync.output == {"n": 1}
        # The synchronous call needs no store: it did not wait for the open.
        assert isinstance(queued, Accepted)
        assert time.monotonic() - started >= 0.4  # the job's record waited for the store
        job = await instance.jobs.get(queued.job.id, key_id=None, wait_s=10.0)
        assert job.status is JobStatus.SUCCEEDED and job.output == {"n": 2}
        assert len(slow_open) == 1, "the store was opened more than once"
        assert errors == []
        text = instance.metrics.render().decode()
        assert 'thaw_jobs_total{status="succeeded"} 1.0' in text
        assert 'thaw_invocations_total{handler="echo",outcome="sync"} 1.0' in text
    finally:
        await instance.stop()


def _unopenable_store(tmp_path: Path) -> Instance:
    """An instance whose SQLite job store lies under a regular file: opening it fails."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    settings = settings_for(tmp_path, job_store=f"sqlite:///{blocker / 'jobs.sqlite3'}")
    return Instance.create(settings, discover(settings.handlers))


async def test_a_store_that_cannot_open_is_reported_to_the_server(tmp_path: Path) -> None:
    instance = _unopenable_store(tmp_path)
    await instance.start(background=False)
    failed = asyncio.Event()
    errors: list[Exception] = []

    def on_error(exc: Exception) -> None:
        errors.append(exc)
        failed.set()

    instance.start_background(on_error=on_error)
    try:
        await asyncio.wait_for(failed.wait(), 10)
        assert isinstance(errors[0], OSError)
    finally:
        await instance.stop()


async def test_without_a_server_a_bad_store_fails_start(tmp_path: Path) -> None:
    instance = _unopenable_store(tmp_path)
    with pytest.raises(OSError):
        await instance.start()
