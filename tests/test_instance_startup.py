"""Start-up order: what an instance defers until the server listens, and that
requests arriving before that deferred work finished are still served."""

from __future__ import annotations

import asyncio
import fcntl
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from runtime.bundles.sources.local import LocalSource
from runtime.clock import ManualClock
from runtime.dispatch.answers import JOB_NOW, Accepted, Completed
from runtime.instance import Instance
from runtime.jobs.job import JobStatus
from runtime.jobs.store import DeferredStore
from runtime.registry import discover
from runtime.settings import Settings
from tests.support import settings_for

pytestmark = pytest.mark.anyio


def echo_settings(tmp_path: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        # In a directory of its own: `held_open` holds its lock.
        "job_store": f"sqlite:///{tmp_path / 'jobs' / 'jobs.sqlite3'}",
        "handlers": ("tests.handlers.echo",),
        **overrides,
    }
    return settings_for(tmp_path, **values)


@pytest.fixture
def held_open(tmp_path: Path) -> Iterator[Callable[[], None]]:
    """The store's opening held up until the returned function is called.

    A SQLite store opens its file under an exclusive flock on the file's
    directory (runtime/jobs/stores/sqlite.py), so holding that lock here holds
    every open of the store until it is let go: a real lock, no sleep.
    """
    directory = tmp_path / "jobs"
    directory.mkdir()
    fd = os.open(directory, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    held = [True]

    def release() -> None:
        if held[0]:
            held[0] = False
            os.close(fd)  # drops the flock

    yield release
    release()


async def test_creating_an_instance_opens_no_store(tmp_path: Path) -> None:
    settings = echo_settings(tmp_path)
    instance = Instance.create(settings, discover(settings.handlers))
    assert not instance.store.opened
    assert not (tmp_path / "jobs" / "jobs.sqlite3").exists()
    await instance.start()  # background=True: prepared before it returns
    try:
        assert instance.store.opened
    finally:
        await instance.stop()


def test_one_clock_reaches_every_component_that_reads_time(tmp_path: Path) -> None:
    clock = ManualClock()
    settings = echo_settings(tmp_path)
    instance = Instance.create(settings, discover(settings.handlers), clock=clock)
    cache, jobs = instance.cache, instance.jobs
    source = cache.source
    assert isinstance(source, LocalSource) and source.stamps is not None
    readers = {
        "instance": instance.clock,
        "health": instance.health.clock,
        "cache": cache.clock,
        "budget": cache.budget.clock,
        "stamps": source.stamps.clock,
        "job store": instance.store.clock,
        "jobs": jobs.clock,
        "job leases": jobs.leases.clock,
        "store calls": jobs.access.clock,
    }
    assert {name: c for name, c in readers.items() if c is not clock} == {}


async def test_requests_during_background_start_are_served(
    tmp_path: Path, held_open: Callable[[], None]
) -> None:
    settings = echo_settings(tmp_path)
    instance = Instance.create(settings, discover(settings.handlers))
    await instance.start(background=False)  # as the server's lifespan does
    errors: list[Exception] = []
    instance.start_background(on_error=errors.append)  # as the server does once listening
    try:
        # Both arrive while the store is still being opened in a worker thread.
        queued_call = asyncio.ensure_future(
            instance.dispatcher.invoke("echo", {"n": 2}, policy=JOB_NOW, request_id="b")
        )
        sync = await instance.dispatcher.invoke("echo", {"n": 1}, wait_s=5.0, request_id="a")
        # The synchronous call needs no store: it was answered during the open.
        assert isinstance(sync, Completed) and sync.output == {"n": 1}
        # The job's record waits for the store: no 202 for a job not yet durable.
        assert not queued_call.done() and not instance.store.opened
        held_open()
        queued = await asyncio.wait_for(queued_call, 30)
        assert isinstance(queued, Accepted)
        job = await instance.jobs.get(queued.job.id, key_id=None, wait_s=10.0)
        assert job.status is JobStatus.SUCCEEDED and job.output == {"n": 2}
        # One store, opened once, serves the start-up work and the record alike.
        assert instance.store.opened and instance.store.open() is instance.store.open()
        assert errors == []
        text = instance.metrics.render().decode()
        assert 'thaw_jobs_total{status="succeeded"} 1.0' in text
        assert 'thaw_invocations_total{handler="echo",outcome="sync"} 1.0' in text
    finally:
        held_open()
        await instance.stop()


def test_threads_asking_during_the_open_all_get_the_one_store(
    tmp_path: Path, held_open: Callable[[], None]
) -> None:
    store = DeferredStore(f"sqlite:///{tmp_path / 'jobs' / 'jobs.sqlite3'}", ttl_s=60.0)
    with ThreadPoolExecutor(8) as pool:
        opens = [pool.submit(store.open) for _ in range(8)]
        assert not any(f.done() for f in opens) and not store.opened
        held_open()
        opened = [f.result(timeout=30) for f in opens]
    try:
        assert all(s is opened[0] for s in opened), "the store was opened more than once"
    finally:
        store.close()


def _unopenable_store(tmp_path: Path) -> Instance:
    """An instance whose SQLite job store lies under a regular file: opening it fails."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    settings = echo_settings(tmp_path, job_store=f"sqlite:///{blocker / 'jobs.sqlite3'}")
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
