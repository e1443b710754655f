"""No progress, no end (issue 15, item 2): load phases and handler runs that stop
making progress fail with a clear error, their waiters and jobs get it, an unload
answers at once, and a thread of user code left stuck wedges the instance
(readiness off, drain) instead of holding it forever.

User code waits for a release file (tests/handlers/stuck.py); every test
releases it before it ends, so no thread outlives the test. Deadlines are
short settings; the assertions are about order and outcome, never duration.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from runtime.dispatch.answers import Accepted, Completed
from runtime.errors import Draining, HandlerTimeout, LoadFailed
from runtime.instance import Instance
from runtime.jobs.job import JobStatus
from runtime.models.lifecycle import State
from runtime.models.weights import host
from runtime.registry import discover
from runtime.settings import Settings
from tests.support import ServerProcess, make_bundle, until

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def release(tmp_path: Path) -> Path:
    return tmp_path / "release"


def settings_for(tmp_path: Path, release: Path, **overrides: Any) -> Settings:
    for name in ("stuck", "warmstuck"):
        make_bundle(tmp_path / "bundles", name, config={"release": str(release)})
    values: dict[str, Any] = {
        "bundle_source": str(tmp_path / "bundles"),
        "cache_dir": str(tmp_path / "cache"),
        "state_dir": str(tmp_path / "state"),
        "job_store": f"sqlite:///{tmp_path / 'jobs.sqlite3'}",
        "handlers": ("tests.handlers.stuck",),
        "drain_grace_s": 0.5,
        **overrides,
    }
    return Settings(**values)


@pytest.fixture
async def started(tmp_path: Path, release: Path) -> AsyncIterator[Any]:
    """A factory of started instances; each is stopped, and user code released, at the end."""
    instances: list[Instance] = []

    async def start(**overrides: Any) -> Instance:
        settings = settings_for(tmp_path, release, **overrides)
        instance = Instance.create(settings, discover(settings.handlers))
        await instance.start()
        instances.append(instance)
        return instance

    try:
        yield start
    finally:
        release.touch()
        for instance in instances:
            await instance.stop()


async def windows_closed() -> bool:
    """Whether every bundle window closes (threads of earlier tests may be ending)."""
    for _ in range(6000):
        if host.windows_open() == 0:
            return True
        await asyncio.sleep(0.01)
    return False


async def test_a_builder_that_hangs_fails_the_load_naming_init_and_wedges(
    started: Any, release: Path
) -> None:
    instance: Instance = await started(phase_stall_s=0.3)
    job = await instance.dispatcher.invoke("stuckmodel", {}, respond_async=True, request_id="job")
    assert isinstance(job, Accepted)
    with pytest.raises(LoadFailed, match="init made no progress") as failed:
        await instance.dispatcher.invoke("stuckmodel", {}, wait_s=60.0, request_id="sync")
    assert failed.value.extra["phase"] == "init"
    entry = instance.cache.entries["stuck"]
    assert entry.lifecycle.state is State.FAILED
    assert entry.lifecycle.error is not None and entry.lifecycle.error["phase"] == "init"
    assert instance.cache.reserved_bytes() == 0
    # The job waiting for that load got the same error, not an endless `running`.
    final = await instance.jobs.get(job.job.id, key_id=None, wait_s=10.0)
    assert final.status is JobStatus.FAILED
    assert final.error is not None and final.error["type"] == "load-failed"
    # The builder's thread cannot be stopped: the instance is wedged and drains.
    assert not release.exists(), "the builder must still be stuck at this point"
    assert instance.health.wedged is not None and "init" in instance.health.wedged.detail
    assert instance.draining and not instance.ready()


async def test_a_warm_up_that_hangs_fails_the_load_naming_warmup(
    started: Any, release: Path
) -> None:
    instance: Instance = await started(phase_stall_s=0.3)
    with pytest.raises(LoadFailed, match="warmup made no progress"):
        await instance.dispatcher.invoke("warmhang", {}, wait_s=60.0, request_id="sync")
    assert instance.cache.entries["warmstuck"].lifecycle.error is not None
    assert instance.health.wedged is not None and "warmup" in instance.health.wedged.detail


async def test_unloading_a_bundle_whose_builder_hangs_answers_at_once(
    started: Any, release: Path
) -> None:
    """The unload answers while the builder's thread goes on; that thread keeps a
    bundle window of its own until it ends, after the load's closed, so what it
    still allocates is mapped and given back when freed, as the load's memory is
    (host.py)."""
    assert await windows_closed()
    instance: Instance = await started(phase_stall_s=600.0)
    request = asyncio.ensure_future(
        instance.dispatcher.invoke("stuckmodel", {}, wait_s=600.0, request_id="sync")
    )
    entry = instance.cache.entry("stuck")
    while entry.lifecycle.state is not State.LOADED:  # the builder has started
        await asyncio.sleep(0.01)
    await instance.cache.unload("stuck")
    assert not release.exists(), "unload returned only because the builder was released"
    assert entry.lifecycle.state is State.FAILED
    with pytest.raises(LoadFailed, match="unloaded while loading"):
        await request
    assert entry.task is None  # the load has ended
    assert host.windows_open() == 1, "the builder's thread left allocating outside a window"
    release.touch()
    assert await windows_closed()  # the builder saw the release file and returned


async def test_a_warm_up_left_running_by_its_stall_runs_in_a_bundle_window(
    started: Any, release: Path
) -> None:
    assert await windows_closed()
    instance: Instance = await started(phase_stall_s=0.3)
    with pytest.raises(LoadFailed, match="warmup made no progress"):
        await instance.dispatcher.invoke("warmhang", {}, wait_s=60.0, request_id="sync")
    assert instance.cache.entries["warmstuck"].task is None  # the load has ended
    assert host.windows_open() == 1, "the warm-up's thread left allocating outside a window"
    release.touch()
    assert await windows_closed()


async def test_a_sync_handler_past_the_run_limit_fails_and_wedges(
    started: Any, release: Path
) -> None:
    instance: Instance = await started(run_timeout_s=0.3)
    with pytest.raises(HandlerTimeout, match="THAW_RUN_TIMEOUT_S"):
        await instance.dispatcher.invoke(
            "hang", {"release": str(release)}, wait_s=60.0, request_id="sync"
        )
    assert not release.exists()
    assert instance.health.wedged is not None and "hang" in instance.health.wedged.detail
    assert instance.draining


async def test_a_job_of_an_async_handler_past_the_run_limit_fails_without_wedging(
    started: Any, release: Path
) -> None:
    """An async handler is cancelled: nothing is left running, so nothing is wedged."""
    instance: Instance = await started(run_timeout_s=0.3)
    accepted = await instance.dispatcher.invoke(
        "ahang", {"release": str(release)}, respond_async=True, request_id="job"
    )
    assert isinstance(accepted, Accepted)
    final = await instance.jobs.get(accepted.job.id, key_id=None, wait_s=10.0)
    assert final.status is JobStatus.FAILED
    assert final.error is not None and final.error["type"] == "handler-timeout"
    assert instance.health.ok and not instance.draining
    assert instance.dispatcher.pending["ahang"] == 0


async def test_an_async_batch_past_the_run_limit_is_cancelled_and_frees_its_slot(
    started: Any, release: Path
) -> None:
    """Its only member fails with handler-timeout; the batch itself is cancelled, so
    the handler's one batch slot is free and the next request runs, nothing wedged."""
    from tests.handlers import stuck

    stuck.CANCELLED.clear()
    instance: Instance = await started(run_timeout_s=0.3)
    with pytest.raises(HandlerTimeout, match="THAW_RUN_TIMEOUT_S"):
        await instance.dispatcher.invoke(
            "ahang_batch", {"release": str(release)}, wait_s=60.0, request_id="hangs"
        )
    batcher = instance.dispatcher.batcher
    for _ in range(1000):  # the cancellation, then the batch's end, on the loop's next turns
        if batcher.running("ahang_batch") == 0:
            break
        await asyncio.sleep(0.01)
    assert batcher.running("ahang_batch") == 0
    assert stuck.CANCELLED == [1]
    assert not release.exists()
    quick = await instance.dispatcher.invoke(
        "ahang_batch", {"quick": True}, wait_s=60.0, request_id="next"
    )
    assert isinstance(quick, Completed) and quick.output == {"released": False}
    assert instance.health.ok and not instance.draining


async def test_an_async_batch_whose_members_a_drain_cut_off_is_cancelled(
    started: Any, release: Path
) -> None:
    """A cut-off from outside (the outcome cancelled, its member settled a callback
    later) also frees the batch: the batch sees its member's outcome done at once."""
    from tests.handlers import stuck

    stuck.CANCELLED.clear()
    instance: Instance = await started()
    dispatcher = instance.dispatcher
    request = asyncio.ensure_future(
        dispatcher.invoke("ahang_batch", {"release": str(release)}, wait_s=60.0, request_id="cut")
    )
    for _ in range(1000):
        if dispatcher.batcher.running("ahang_batch") == 1:
            break
        await asyncio.sleep(0.01)
    assert dispatcher.batcher.running("ahang_batch") == 1
    dispatcher.abort_in_flight()
    with pytest.raises(Draining):
        await request
    for _ in range(1000):  # the cancellation, then the batch's end, on the loop's next turns
        if dispatcher.batcher.running("ahang_batch") == 0:
            break
        await asyncio.sleep(0.01)
    assert dispatcher.batcher.running("ahang_batch") == 0
    assert stuck.CANCELLED == [1]
    assert not release.exists()
    assert not dispatcher.in_flight and dispatcher.pending["ahang_batch"] == 0


def test_a_wedged_server_reports_unready_then_drains_and_exits(
    tmp_path: Path, release: Path, thaw_env: dict[str, str]
) -> None:
    """The policy end to end: a builder stuck past its deadline makes the server
    answer /readyz 503, let the work in flight finish, and leave, so the platform
    replaces it. A request held in flight keeps the drain open while /readyz is
    asked: without one the server may be gone before the question arrives."""
    settings_for(tmp_path, release)  # writes the bundles
    env = {
        **thaw_env,
        "THAW_BUNDLE_SOURCE": str(tmp_path / "bundles"),
        "THAW_HANDLERS": "tests.handlers.stuck",
        # Above what a healthy phase of a fresh process takes on a loaded machine (the
        # framework's import, the weights' read): only the stuck builder may stall.
        "THAW_PHASE_STALL_S": "5",
        # Longer than the test: the held request, not the grace, ends the drain.
        "THAW_DRAIN_GRACE_S": "300",
    }
    held, started = tmp_path / "held", tmp_path / "started"
    server = ServerProcess(env).start()
    try:
        with server.client() as client, server.client() as other, ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(
                other.post,
                "/invoke/hang",
                json={"release": str(held), "started": str(started)},
                headers={"Prefer": "wait=60"},
                timeout=120.0,
            )
            until(started.exists, "the held request running")
            response = client.post("/invoke/stuckmodel", json={}, headers={"Prefer": "wait=30"})
            assert response.status_code == 503
            assert response.json()["type"].endswith("/load-failed")
            ready = client.get("/readyz")
            assert ready.status_code == 503
            conditions = ready.json()["conditions"]
            assert conditions and "init" in conditions[0]["detail"]
            assert server.proc is not None and server.proc.poll() is None  # draining
            held.touch()
            assert in_flight.result().json() == {"released": True}
        code = server.proc.wait(timeout=60)  # leaves on its own, the builder still stuck
        assert not release.exists()
        assert code == 1, server.log()
        assert "wedged" in server.log()
    finally:
        held.touch()
        release.touch()
        server.kill()
