"""No progress, no end (issue 15, item 2): load phases and handler runs that stop
making progress fail with a clear error, their waiters and jobs get it, an unload
answers at once, and a thread of user code left stuck wedges the instance
(readiness off, drain) instead of holding it forever.

User code waits for a release file (tests/handlers/stuck.py); every test
releases it before it ends, so no thread outlives the test. In-process, the
deadlines are on a manual clock, stepped past once the phase or run they bound
has begun; the assertions are about order and outcome, never duration.

A stall that wedges the instance and the load failure it causes race: the
wedge's drain cuts off what is still in flight at the end of its grace. The
waiters of the load get `load-failed` whichever way that drain is set (no grace:
it cuts off at once; a grace the clock then passes).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from runtime.clock import SYSTEM, Clock, ManualClock
from runtime.dispatch.answers import JOB_NOW, Accepted, Completed
from runtime.errors import Draining, HandlerTimeout, LoadFailed
from runtime.instance import Instance
from runtime.jobs.job import JobStatus
from runtime.models.lifecycle import State
from runtime.models.weights import host
from runtime.registry import discover
from runtime.settings import Settings
from tests.inproc import until
from tests.support import ServerProcess, make_bundle, settings_for
from tests.support import until as until_sync

pytestmark = pytest.mark.anyio

# The stall deadline and the run limit of the tests, which step a manual clock past them.
STALL_S = 5.0
RUN_LIMIT_S = 5.0


@pytest.fixture
def release(tmp_path: Path) -> Path:
    return tmp_path / "release"


def stuck_settings(tmp_path: Path, release: Path, **overrides: Any) -> Settings:
    for name in ("stuck", "stuckraises", "warmstuck"):
        make_bundle(tmp_path / "bundles", name, config={"release": str(release)})
    values: dict[str, Any] = {"handlers": ("tests.handlers.stuck",), "drain_grace_s": 0.5}
    return settings_for(tmp_path, **{**values, **overrides})


@pytest.fixture
async def started(tmp_path: Path, release: Path) -> AsyncIterator[Any]:
    """A factory of started instances; each is stopped, and user code released, at the end."""
    instances: list[Instance] = []

    async def start(clock: Clock = SYSTEM, **overrides: Any) -> Instance:
        settings = stuck_settings(tmp_path, release, **overrides)
        instance = Instance.create(settings, discover(settings.handlers), clock=clock)
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


# The drain a wedge begins cuts off, at the end of its grace, what is still in flight:
# at once (no grace), or once the clock has moved past it.
DRAIN_ORDERS = pytest.mark.parametrize(
    "drain_grace_s", [0.0, 300.0], ids=["drain-at-once", "drain-after-grace"]
)


async def stall(
    instance: Instance, clock: ManualClock, handler: str, bundle: str, begun: State
) -> tuple[Accepted, asyncio.Future[Any]]:
    """A job and a waiting request of `handler`, whose load of `bundle` has reached
    `begun` (its stuck phase started, its stall deadline armed); then the clock moves
    past that deadline."""
    job = await instance.dispatcher.invoke(handler, {}, policy=JOB_NOW, request_id="job")
    assert isinstance(job, Accepted)
    request = asyncio.ensure_future(
        instance.dispatcher.invoke(handler, {}, wait_s=60.0, request_id="sync")
    )
    entry = instance.cache.entry(bundle)
    # The state changes in the step that starts the phase and arms its deadline.
    await until(lambda: entry.lifecycle.state is begun, f"{bundle} {begun}")
    clock.advance(STALL_S)
    return job, request


async def failed_and_wedged(
    instance: Instance,
    clock: ManualClock,
    job: Accepted,
    request: asyncio.Future[Any],
    phase: str,
    drain_grace_s: float,
) -> None:
    """The request and the job end with the load failure naming `phase`, whichever
    way the wedge's drain is set to cut off what is in flight; the instance is
    wedged, drains, and the drain ends once its grace is over."""
    with pytest.raises(LoadFailed, match=f"{phase} made no progress") as failed:
        await request
    assert failed.value.extra["phase"] == phase
    # The job waiting for that load got the same error, not an endless `running`
    # nor the drain's `drained`.
    final = await instance.jobs.get(job.job.id, key_id=None, wait_s=10.0)
    assert final.status is JobStatus.FAILED
    assert final.error is not None and final.error["type"] == "load-failed", final.error
    # The user code's thread cannot be stopped: the instance is wedged and drains.
    wedged = await until(lambda: instance.health.wedged, "the instance wedged")
    assert phase in wedged.detail
    assert instance.draining and not instance.ready()
    drain = instance._drain
    assert drain is not None
    clock.advance(drain_grace_s)
    await until(drain.done, "the drain's end")


@DRAIN_ORDERS
async def test_a_builder_that_hangs_fails_the_load_naming_init_and_wedges(
    started: Any, release: Path, drain_grace_s: float
) -> None:
    clock = ManualClock()
    instance: Instance = await started(
        clock=clock, phase_stall_s=STALL_S, drain_grace_s=drain_grace_s
    )
    job, request = await stall(instance, clock, "stuckmodel", "stuck", State.LOADED)
    await failed_and_wedged(instance, clock, job, request, "init", drain_grace_s)
    entry = instance.cache.entries["stuck"]
    assert entry.lifecycle.state is State.FAILED
    assert entry.lifecycle.error is not None and entry.lifecycle.error["phase"] == "init"
    assert instance.cache.reserved_bytes() == 0
    assert not release.exists(), "the builder must still be stuck at this point"


@DRAIN_ORDERS
async def test_a_warm_up_that_hangs_fails_the_load_naming_warmup(
    started: Any, release: Path, drain_grace_s: float
) -> None:
    clock = ManualClock()
    instance: Instance = await started(
        clock=clock, phase_stall_s=STALL_S, drain_grace_s=drain_grace_s
    )
    job, request = await stall(instance, clock, "warmhang", "warmstuck", State.INITIALIZED)
    await failed_and_wedged(instance, clock, job, request, "warmup", drain_grace_s)
    assert instance.cache.entries["warmstuck"].lifecycle.error is not None
    assert not release.exists(), "the warm-up must still be stuck at this point"


@pytest.mark.parametrize("first", ["stall", "failure", "both"])
async def test_a_stall_and_the_builders_own_failure_racing_fail_the_load_naming_init(
    started: Any, release: Path, first: str
) -> None:
    """The stall deadline passes and the builder raises: first one, then the other,
    or both before the load is looked at again. Whichever the load sees first, the
    request gets load-failed naming init; only a stall wedges the instance."""
    clock = ManualClock()
    instance: Instance = await started(clock=clock, phase_stall_s=STALL_S, drain_grace_s=0.0)
    request = asyncio.ensure_future(
        instance.dispatcher.invoke("stuckraisesmodel", {}, wait_s=60.0, request_id="sync")
    )
    entry = instance.cache.entry("stuckraises")
    await until(lambda: entry.lifecycle.state is State.LOADED, "the builder started")
    if first == "stall":
        clock.advance(STALL_S)
        await until(request.done, "the load's failure")
        release.touch()
    elif first == "failure":
        release.touch()
        await until(request.done, "the load's failure")
        clock.advance(STALL_S)
    else:  # in one step of the loop: which the load sees first is the race's
        release.touch()
        clock.advance(STALL_S)
    with pytest.raises(LoadFailed) as failed:
        await request
    assert failed.value.extra["phase"] == "init"
    assert entry.lifecycle.error is not None and entry.lifecycle.error["phase"] == "init"
    if first == "stall":
        assert "made no progress" in failed.value.message
        assert await until(lambda: instance.health.wedged, "the instance wedged")
    elif first == "failure":
        assert "raised RuntimeError" in failed.value.message
        for _ in range(5):  # a stall's timer would have fired inside advance()
            await asyncio.sleep(0)
        assert instance.health.wedged is None and not instance.draining


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
    await until(lambda: entry.lifecycle.state is State.LOADED, "the builder started")
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
    clock = ManualClock()
    instance: Instance = await started(clock=clock, phase_stall_s=STALL_S)
    _, request = await stall(instance, clock, "warmhang", "warmstuck", State.INITIALIZED)
    with pytest.raises(LoadFailed, match="warmup made no progress"):
        await request
    assert instance.cache.entries["warmstuck"].task is None  # the load has ended
    assert host.windows_open() == 1, "the warm-up's thread left allocating outside a window"
    release.touch()
    assert await windows_closed()


async def past_the_run_limit(instance: Instance, clock: ManualClock) -> None:
    """Once the one run of the test is watched (its run limit armed), the clock
    moves past that limit."""
    overruns = instance.executor.overruns
    await until(lambda: len(overruns) == 1, "the run watched")
    clock.advance(RUN_LIMIT_S)


async def test_a_sync_handler_past_the_run_limit_fails_and_wedges(
    started: Any, release: Path
) -> None:
    clock = ManualClock()
    instance: Instance = await started(clock=clock, run_timeout_s=RUN_LIMIT_S)
    request = asyncio.ensure_future(
        instance.dispatcher.invoke(
            "hang", {"release": str(release)}, wait_s=60.0, request_id="sync"
        )
    )
    await past_the_run_limit(instance, clock)
    with pytest.raises(HandlerTimeout, match="THAW_RUN_TIMEOUT_S"):
        await request
    assert not release.exists()
    assert instance.health.wedged is not None and "hang" in instance.health.wedged.detail
    assert instance.draining


async def test_a_job_of_an_async_handler_past_the_run_limit_fails_without_wedging(
    started: Any, release: Path
) -> None:
    """An async handler is cancelled: nothing is left running, so nothing is wedged."""
    clock = ManualClock()
    instance: Instance = await started(clock=clock, run_timeout_s=RUN_LIMIT_S)
    accepted = await instance.dispatcher.invoke(
        "ahang", {"release": str(release)}, policy=JOB_NOW, request_id="job"
    )
    assert isinstance(accepted, Accepted)
    await past_the_run_limit(instance, clock)
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
    clock = ManualClock()
    instance: Instance = await started(clock=clock, run_timeout_s=RUN_LIMIT_S)
    request = asyncio.ensure_future(
        instance.dispatcher.invoke(
            "ahang_batch", {"release": str(release)}, wait_s=60.0, request_id="hangs"
        )
    )
    await past_the_run_limit(instance, clock)
    with pytest.raises(HandlerTimeout, match="THAW_RUN_TIMEOUT_S"):
        await request
    batcher = instance.dispatcher.batcher
    # The cancellation, then the batch's end, on the loop's next turns.
    await until(lambda: batcher.running("ahang_batch") == 0, "the batch's end")
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
    await until(lambda: dispatcher.batcher.running("ahang_batch") == 1, "the batch running")
    dispatcher.abort_in_flight()
    with pytest.raises(Draining):
        await request
    # The cancellation, then the batch's end, on the loop's next turns.
    await until(lambda: dispatcher.batcher.running("ahang_batch") == 0, "the batch's end")
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
    stuck_settings(tmp_path, release)  # writes the bundles
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
            until_sync(started.exists, "the held request running")
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
